"""Engram n-gram hashing (MODEL.md §8.1–§8.4): bucket primes, multipliers, the compressed token
map and the per-position hash ids. The embedding table and gating live in the model.

Everything but `engram_hash_ids` is plain Python run once at load time. `engram_hash_ids` uses
tensor ops only, so it traces under `torch.compile(fullgraph=True)` for prefill and decode.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from tokenizers import Regex, normalizers

from dsv41c.errors import ConfigError

DEAD = -1
"""History value of a position whose token never takes part in an n-gram (image tokens)."""

_SENTINEL = "\ue000"


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n < 4:
        return True
    if n % 2 == 0 or n % 3 == 0:
        return False
    limit = math.isqrt(n)
    d = 5
    while d <= limit:
        if n % d == 0 or n % (d + 2) == 0:
            return False
        d += 6
    return True


def _engram_dims(args) -> tuple[list[int], int, int]:
    layer_ids = [int(i) for i in args.engram_layer_ids]
    n_max = int(args.engram_max_ngram_size)
    n_heads = int(args.engram_n_heads)
    if layer_ids and n_max < 2:
        raise ConfigError(f"engram_max_ngram_size: expected >= 2 with engram layers, found {n_max}")
    if layer_ids and n_heads < 1:
        raise ConfigError(f"engram_n_heads: expected >= 1 with engram layers, found {n_heads}")
    return layer_ids, n_max, n_heads


def engram_primes(args) -> list[list[list[int]]]:
    """Bucket primes P[ℓ][n−2][η] (§8.1): per (layer, n-gram size) the search restarts just above
    `engram_vocab_size − 1`, and no prime is used twice in the whole model."""
    layer_ids, n_max, n_heads = _engram_dims(args)
    start = int(args.engram_vocab_size) - 1
    used: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_layer = []
        for _n in range(2, n_max + 1):
            cur = start
            heads = []
            for _h in range(n_heads):
                cur += 1
                while cur in used or not is_prime(cur):
                    cur += 1
                used.add(cur)
                heads.append(cur)
            per_layer.append(heads)
        primes.append(per_layer)
    return primes


def engram_offsets(primes_of_layer: list[list[int]]) -> list[int]:
    """Row offset of every hash column c = (n−2)·H_e + η: the sum of the primes of columns < c."""
    offsets, total = [], 0
    for heads in primes_of_layer:
        for p in heads:
            offsets.append(total)
            total += p
    return offsets


def engram_multiplier_bound(compressed_vocab_size: int) -> int:
    return max(1, ((2**63 - 1) // int(compressed_vocab_size)) // 2)


def engram_multipliers(args) -> list[list[int]]:
    """Odd hash multipliers μ[ℓ][0..N−1] (§8.2), seeded by 10007 · layer id."""
    layer_ids, n_max, _ = _engram_dims(args)
    v_c = int(args.engram_compressed_vocab_size)
    if layer_ids and v_c < 1:
        raise ConfigError(f"engram_compressed_vocab_size: expected >= 1 with engram layers, found {v_c}")
    bound = engram_multiplier_bound(v_c) if layer_ids else 1
    out = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(seed=10007 * layer_id)
        values = rng.integers(low=0, high=bound, size=n_max, dtype=np.int64)
        out.append([2 * int(v) + 1 for v in values])
    return out


def _key_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """Map every raw token id to its compressed class (§8.3). Returns (LongTensor [len], V_c).

    `tokenizer` is a `dsv41c.tokenizer.Tokenizer` or a bare `tokenizers.Tokenizer`.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _key_normalizer()
    classes: dict[str, int] = {}
    mapping = []
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(i)
            key = text if key is None else key
        else:
            key = norm.normalize_str(text) or text
        mapping.append(classes.setdefault(key, len(classes)))
    return torch.tensor(mapping, dtype=torch.int64), len(classes)


class EngramLayout(nn.Module):
    """Hash constants of all engram layers as int64 tensors.

    primes, offsets: [L_e, C] with C = (N−1)·H_e in column order c = (n−2)·H_e + η;
    multipliers: [L_e, N]; token_map: [V] raw id -> compressed id; pad: compressed pad id (int).
    `tokens` is a Tokenizer or a precomputed (token_map, V_c) pair.

    The tensors are non-persistent buffers: they move with the model and stay out of its state
    dict, and torch.compile sees them with static shapes (as plain tensor attributes they were
    dynamic graph inputs, whose size symbols a frozen Inductor graph can lose). They are computed
    on the CPU; `reset` writes them again, e.g. after `to_empty`.
    """

    def __init__(self, args, tokens):
        super().__init__()
        layer_ids, n_max, n_heads = _engram_dims(args)
        if isinstance(tokens, tuple):
            token_map, v_c = tokens
            token_map = torch.as_tensor(token_map, dtype=torch.int64)
            v_c = int(v_c)
        else:
            token_map, v_c = compressed_token_map(tokens)
        expected_vc = int(args.engram_compressed_vocab_size)
        if v_c != expected_vc:
            raise ConfigError(f"engram_compressed_vocab_size: expected the tokenizer's {v_c} "
                              f"compressed classes, found {expected_vc}")
        pad_id = int(args.engram_pad_id)
        if not 0 <= pad_id < token_map.numel():
            raise ConfigError(f"engram_pad_id: expected a token id in [0, {token_map.numel()}), "
                              f"found {pad_id}")
        sizes = [int(s) for s in args.engram_num_embeddings]
        if len(sizes) != len(layer_ids):
            raise ConfigError(f"engram_num_embeddings: expected {len(layer_ids)} entries (one per "
                              f"engram_layer_ids), found {len(sizes)}")
        primes = engram_primes(args)
        for layer_id, size, layer_primes in zip(layer_ids, sizes, primes):
            need = sum(sum(heads) for heads in layer_primes)
            if size < need:
                raise ConfigError(f"engram_num_embeddings: layer {layer_id} needs >= {need} rows "
                                  f"(sum of its bucket primes), found {size}")
        self.layer_ids = layer_ids
        self.max_ngram_size = n_max
        self.n_heads = n_heads
        self.compressed_vocab_size = v_c
        self.n_cols = (n_max - 1) * n_heads
        n_layers = len(layer_ids)
        flat = [[p for heads in layer for p in heads] for layer in primes]
        self._host = {
            "primes": torch.tensor(flat, dtype=torch.int64).reshape(n_layers, self.n_cols),
            "offsets": torch.tensor([engram_offsets(layer) for layer in primes],
                                    dtype=torch.int64).reshape(n_layers, self.n_cols),
            "multipliers": torch.tensor(engram_multipliers(args), dtype=torch.int64).reshape(n_layers, n_max),
            "token_map": token_map.cpu(),
        }
        for name, value in self._host.items():
            self.register_buffer(name, value.clone(), persistent=False)
        self.pad = int(token_map[pad_id])

    def reset(self) -> "EngramLayout":
        """Write the constants into the buffers again (on whatever device they are)."""
        for name, value in self._host.items():
            getattr(self, name).copy_(value)
        return self

    def new_history(self, batch: int, max_seq_len: int, device=None) -> torch.Tensor:
        """A [batch, max_seq_len] int64 cache of compressed ids for `engram_hash_ids`."""
        return torch.full((batch, max_seq_len), DEAD, dtype=torch.int64,
                          device=device if device is not None else self.token_map.device)


def engram_hash_ids(layout: EngramLayout, ids: torch.Tensor, start_pos: int,
                    history: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
    """Hash ids [B, S, L_e, C] of the tokens `ids` [B, S] at positions start_pos … start_pos+S−1.

    Stores their compressed ids into `history[:, start_pos:start_pos+S]` first, then reads back
    positions start_pos−N+1 … start_pos+S−1. Positions flagged in `dead` [B, S] (image tokens)
    and ids outside the token map are stored as DEAD; a DEAD or negative look-back and every
    longer one become the pad class (§8.4).
    """
    n_max = layout.max_ngram_size
    token_map = layout.token_map
    n_tokens = token_map.shape[0]
    seq = ids.shape[1]
    in_range = (ids >= 0) & (ids < n_tokens)
    comp = torch.where(in_range, token_map[ids.clamp(0, n_tokens - 1)], DEAD)
    if dead is not None:
        comp = torch.where(dead, DEAD, comp)
    history[:, start_pos:start_pos + seq] = comp

    positions = (start_pos + torch.arange(seq, device=ids.device)[:, None]
                 - torch.arange(n_max, device=ids.device)[None, :])            # [S, N]
    looked = history[:, positions.clamp(min=0)]                                  # [B, S, N]
    looked = torch.where(positions >= 0, looked, DEAD)
    blocked = torch.cummax((looked < 0).to(torch.int64), dim=-1).values.bool()
    toks = torch.where(blocked, layout.pad, looked)

    # toks < V_c and μ < 2·bound ≤ (2^63−1)/V_c: the products fit in int64, the XORs stay ≥ 0.
    products = toks[:, :, None, :] * layout.multipliers                         # [B, S, L, N]
    x = products[..., 0]
    grams = []
    for n in range(1, n_max):
        x = torch.bitwise_xor(x, products[..., n])
        grams.append(x)
    grams = torch.stack(grams, dim=-1)                                          # [B, S, L, N−1]
    cols = grams.repeat_interleave(layout.n_heads, dim=-1)                      # [B, S, L, C]
    return torch.remainder(cols, layout.primes) + layout.offsets
