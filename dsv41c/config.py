"""Model configuration: `ModelArgs` (official key names), HF config.json aliases, validation,
and the layer plan (which layer is a kv source, an index source, Reindex, Reuse, DSpark).

Runs anywhere; no torch needed.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv41c.errors import ConfigError

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def default_config(name: str) -> Path:
    """A built-in config ("tiny.json"), as the CLI's defaults name it: configs/<name> in the current
    directory if it is there (a checkout, or the user's own copy), else the copy installed with the
    package, so the commands run from any directory."""
    local = Path("configs") / name
    if local.exists():
        return local
    return Path(str(importlib.resources.files("dsv41c.configs") / name))


@dataclass
class ModelArgs:
    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1.0
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    vocab_size: int = 129280
    dim: int = 1024
    moe_inter_dim: int = 1024
    n_layers: int = 5
    n_mtp_layers: int = 1
    n_heads: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    q_lora_rank: int = 256
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 256
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1, 0)
    kv_source_layers: tuple[int, ...] = (1, 3)
    index_source_layers: tuple[int, ...] = (1, 3)
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "ModelArgs":
        """Build from the inference `config.json` keys or the HF `config.json` form."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        flat = _from_hf(raw, source) if _looks_like_hf(raw) else dict(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(flat) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (not a ModelArgs field)")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in flat:
                kwargs[f.name] = _coerce(f, flat[f.name], source)
        args = cls(**kwargs)
        args.validate(source)
        return args

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelArgs":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
        return cls.from_dict(raw, source=path)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> "ModelArgs":
        new = dataclasses.replace(self, **changes)
        new.validate("<replace>")
        return new

    # ---------------------------------------------------------------- derived
    @property
    def n_all_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    # ---------------------------------------------------------------- validation
    def validate(self, source: str = "<config>") -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: {key}: {msg}")

        if self.vision_n_layers > 0:
            raise bad("vision_n_layers", f"is {self.vision_n_layers}; the vision tower is out of scope "
                      "for dsv41c (text only), set it to 0")
        if self.hc_mult < 1:
            raise bad("hc_mult", f"must be >= 1, found {self.hc_mult}")
        for key in ("max_batch_size", "max_seq_len", "vocab_size", "dim", "moe_inter_dim", "n_layers",
                    "n_heads", "n_routed_experts", "n_activated_experts", "q_lora_rank", "head_dim",
                    "o_groups", "o_lora_rank", "window_size", "hc_sinkhorn_iters"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, found {getattr(self, key)}")
        if self.n_mtp_layers < 0:
            raise bad("n_mtp_layers", f"must be >= 0, found {self.n_mtp_layers}")
        if self.dtype not in ("fp8", "bf16"):
            raise bad("dtype", f"expected 'fp8' or 'bf16', found {self.dtype!r}")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            raise bad("expert_dtype", f"expected 'fp4' or null, found {self.expert_dtype!r}")
        if self.score_func not in SCORE_FUNCS:
            raise bad("score_func", f"expected one of {SCORE_FUNCS}, found {self.score_func!r}")
        if self.n_shared_experts != 1:
            raise bad("n_shared_experts", f"must be 1, found {self.n_shared_experts}")
        if self.n_activated_experts > self.n_routed_experts:
            raise bad("n_activated_experts", f"{self.n_activated_experts} > n_routed_experts {self.n_routed_experts}")
        if self.n_heads % self.o_groups:
            raise bad("o_groups", f"{self.o_groups} does not divide n_heads {self.n_heads}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= self.head_dim:
            raise bad("rope_head_dim", f"must be even and in (0, head_dim], found {self.rope_head_dim}")
        if self.head_dim % 32:
            raise bad("head_dim", f"must be a multiple of 32 (FP8/FP4 KV blocks), found {self.head_dim}")
        n_all = self.n_all_layers
        if len(self.compress_ratios) != n_all:
            raise bad("compress_ratios", f"needs n_layers + n_mtp_layers = {n_all} entries, found "
                      f"{len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios):
            if r < 0:
                raise bad("compress_ratios", f"entry {i} is {r}; ratios are >= 0")
            if i >= self.n_layers and r != 0:
                raise bad("compress_ratios", f"DSpark layer {i} has ratio {r}; DSpark attention is ratio 0")
        for key in ("kv_source_layers", "index_source_layers"):
            for i in getattr(self, key):
                if not 0 <= i < self.n_layers:
                    raise bad(key, f"layer {i} is not a backbone layer (0..{self.n_layers - 1})")
                if self.compress_ratios[i] == 0:
                    raise bad(key, f"layer {i} has compress ratio 0; a source needs ratio > 0")
        if self.index_source_layers:
            if self.index_head_dim % 32 or self.index_n_heads < 1 or self.index_topk < 1:
                raise bad("index_head_dim", "index_head_dim must be a multiple of 32 and index_n_heads, "
                          f"index_topk >= 1 (found {self.index_head_dim}, {self.index_n_heads}, {self.index_topk})")
            if self.rope_head_dim > self.index_head_dim:
                raise bad("rope_head_dim", f"{self.rope_head_dim} > index_head_dim {self.index_head_dim}")
        plan = build_layer_plan(self, source)  # checks the sharing rules
        if self.candidate_source_layer >= 0:
            c = self.candidate_source_layer
            if c not in self.index_source_layers:
                raise bad("candidate_source_layer", f"layer {c} is not among index_source_layers "
                          f"{list(self.index_source_layers)}")
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                raise bad("candidate_topk_blocks", "candidate_topk_blocks and candidate_block_size must be >= 1 "
                          "when candidate_source_layer is set")
            for role in plan:
                if role.uses_candidates and role.kv_source != plan[c].kv_source:
                    raise bad("candidate_source_layer", f"index source {role.layer_id} after candidate source {c} "
                              "reads another kv source; the candidate mask would not fit")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise bad("engram_num_embeddings", f"needs one entry per engram layer "
                          f"({len(self.engram_layer_ids)}), found {len(self.engram_num_embeddings)}")
            for i in self.engram_layer_ids:
                if not 0 <= i < self.n_layers:
                    raise bad("engram_layer_ids", f"layer {i} is not a backbone layer")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads < 1:
                raise bad("engram_max_ngram_size", "engram needs engram_max_ngram_size >= 2 and engram_n_heads >= 1")
            if self.engram_head_dim < 32 or self.engram_head_dim % 32:
                raise bad("engram_head_dim", f"must be a positive multiple of 32, found {self.engram_head_dim}")
            if not 0 <= self.engram_pad_id < self.vocab_size:
                raise bad("engram_pad_id", f"{self.engram_pad_id} is outside the vocabulary")
        if self.dspark_block_size > 0:
            if self.n_mtp_layers < 1:
                raise bad("n_mtp_layers", "dspark_block_size > 0 needs at least one DSpark stage")
            if not self.dspark_target_layer_ids:
                raise bad("dspark_target_layer_ids", "DSpark needs at least one target layer")
            for i in self.dspark_target_layer_ids:
                if not 0 <= i < self.n_layers:
                    raise bad("dspark_target_layer_ids", f"layer {i} is not a backbone layer")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                raise bad("dspark_noise_token_id", f"{self.dspark_noise_token_id} is outside the vocabulary")


# -------------------------------------------------------------------- layer plan
@dataclass(frozen=True)
class LayerRole:
    """What one layer does in the CSA2 sharing scheme (spec §1.1, §6.6)."""
    layer_id: int
    ratio: int
    is_mtp: bool
    is_kv_source: bool = False
    is_index_source: bool = False
    kv_source: int | None = None      # whose compressed cache (and index keys) this layer reads
    index_source: int | None = None   # whose top-k indices this layer uses
    is_candidate_source: bool = False
    uses_candidates: bool = False     # index source after the candidate source: masks its scores

    @property
    def owns_index_keys(self) -> bool:
        return self.is_kv_source and self.is_index_source

    @property
    def kind(self) -> str:
        if self.is_mtp:
            return "dspark"
        if self.ratio == 0:
            return "swa"
        if self.is_kv_source:
            return "full"
        if self.is_index_source:
            return "reindex"
        return "reuse"


def build_layer_plan(args: ModelArgs, source: str = "<config>") -> list[LayerRole]:
    kv_src, idx_src = set(args.kv_source_layers), set(args.index_source_layers)
    cand = args.candidate_source_layer
    plan: list[LayerRole] = []
    last_kv: int | None = None
    last_idx: int | None = None
    for i in range(args.n_all_layers):
        ratio = args.compress_ratios[i]
        is_mtp = i >= args.n_layers
        if ratio == 0:
            plan.append(LayerRole(i, 0, is_mtp))
            continue
        if i in kv_src:
            last_kv = i
        if i in idx_src:
            last_idx = i
        if last_kv is None or args.compress_ratios[last_kv] != ratio:
            raise ConfigError(f"{source}: kv_source_layers: layer {i} has ratio {ratio} but no kv source of "
                              f"that ratio at or before it (nearest: {last_kv})")
        if last_idx is None or args.compress_ratios[last_idx] != ratio or last_idx < last_kv:
            raise ConfigError(f"{source}: index_source_layers: layer {i} (ratio {ratio}, kv source {last_kv}) "
                              f"has no index source of its segment at or before it (nearest: {last_idx})")
        if i in idx_src and i not in kv_src and last_kv not in idx_src:
            raise ConfigError(f"{source}: index_source_layers: Reindex layer {i} needs index keys, but its "
                              f"kv source {last_kv} is not an index source")
        plan.append(LayerRole(
            i, ratio, is_mtp,
            is_kv_source=i in kv_src, is_index_source=i in idx_src,
            kv_source=last_kv, index_source=last_idx,
            is_candidate_source=(i == cand),
            uses_candidates=(i in idx_src and 0 <= cand < i),
        ))
    return plan


# -------------------------------------------------------------------- HF form
_HF_ALIASES = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "num_experts_per_tok": "n_activated_experts",
    "routed_scaling_factor": "route_scale",
    "rms_norm_eps": "norm_eps",
    "scoring_func": "score_func",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "engram_pad_token_id": "engram_pad_id",
}
_HF_VISION = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads", "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
_HF_ROPE = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
            "original_max_position_embeddings": "original_seq_len"}
# Keys of the HF file that carry no model semantics for dsv41c.
_HF_INFORMATIONAL = {
    "architectures", "model_type", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "num_key_value_heads", "topk_method", "tie_word_embeddings", "max_position_embeddings",
    "hidden_act", "initializer_range", "use_cache", "attention_bias", "attention_dropout", "auto_map",
    "first_k_dense_replace", "n_group", "topk_group", "ep_size", "moe_layer_freq", "dtype",
}


def _looks_like_hf(raw: dict[str, Any]) -> bool:
    return "text_config" in raw or "model_type" in raw or any(k in raw for k in _HF_ALIASES)


def _from_hf(raw: dict[str, Any], source: str) -> dict[str, Any]:
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config: expected an object")
    merged = {**outer, **text}
    out: dict[str, Any] = {}
    for key, value in merged.items():
        if key == "rope_scaling":
            for rk, rv in (value or {}).items():
                if rk in _HF_ROPE:
                    out[_HF_ROPE[rk]] = rv
                elif rk not in ("type", "rope_type", "mscale", "mscale_all_dim"):
                    raise ConfigError(f"{source}: unknown key 'rope_scaling.{rk}'")
        elif key == "quantization_config":
            q = value or {}
            if q.get("quant_method") == "fp8":
                out["dtype"] = "fp8"
            out["expert_dtype"] = q.get("expert_dtype")
        elif key in _HF_INFORMATIONAL:
            continue
        else:
            out[_HF_ALIASES.get(key, key)] = value
    if "quantization_config" not in merged:
        out.setdefault("dtype", "bf16")
        out.setdefault("expert_dtype", None)
    vision = raw.get("vision_config") or {}
    for vk, vv in vision.items():
        if vk in _HF_VISION:
            out[_HF_VISION[vk]] = vv
    out.setdefault("candidate_source_layer", -1)
    return out


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    default = f.default
    try:
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return tuple(int(v) for v in value)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, bool) or int(value) != value:
                raise TypeError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {f.name}: expected {type(default).__name__}, found {value!r}") from None
    return value
