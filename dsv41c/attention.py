"""CSA2 attention (spec §6): sliding window, compressor, indexer with the candidate funnel,
Reuse/Reindex sharing, sparse attention with a sink, and the grouped output projection.

The CED structure lives here and in `config.build_layer_plan`: a layer reads the compressed cache
of its kv source and the top-k of its index source, both resolved once from the config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv41c import quant
from dsv41c.cache import LayerCache, ModelCache
from dsv41c.config import LayerRole, ModelArgs
from dsv41c.nn import Linear, RMSNorm, apply_rope, weight_format

SPARSE_ATTN_BLOCK = 64


@dataclass
class CallState:
    """What the layers of one forward call share (the reference's per-call runtime slots)."""
    start_pos: int
    seqlen: int
    batch: int
    rope: dict[str, torch.Tensor]                       # "swa"/"compressed" -> [L, d_r/2, 2]
    cache: ModelCache
    topk: dict[int, torch.Tensor] = field(default_factory=dict)   # index source -> [B,S,k'] int32
    candidates: torch.Tensor | None = None              # [B,S,n_c] bool, from the candidate source
    main_x: torch.Tensor | None = None                  # DSpark: backbone-derived input

    @property
    def is_prefill(self) -> bool:
        return self.start_pos == 0

    def positions(self, offset: int = 0, count: int | None = None) -> slice:
        start = self.start_pos + offset
        return slice(start, start + (self.seqlen if count is None else count))


# ------------------------------------------------------------------------------------ sparse attention
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of q [B,S,H,d] over the rows of kv [B,N,d] listed in idx [B,S,K] (-1 = none).

    KV rows are keys and values. The per-head sink logit [H] (fp32) joins the denominator only.
    fp32 inputs: an exact softmax. bf16 inputs: the official kernel's numerics (online softmax
    over blocks of 64 list entries, probabilities rounded to bf16 before the value product).
    A query with no valid entry returns 0.
    """
    b, s, h, d = q.shape
    k = idx.shape[-1]
    valid = idx >= 0
    rows = kv.gather(1, idx.clamp(min=0).long().flatten(1).unsqueeze(-1).expand(-1, -1, d)).view(b, s, k, d)
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink = sink.float().view(1, 1, h)
    if q.dtype == torch.float32:
        m = logits.amax(dim=-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m.unsqueeze(-1))
        den = p.sum(dim=-1) + torch.exp(sink - m)
        return (torch.einsum("bshk,bskd->bshd", p, rows.float()) / den.unsqueeze(-1)).to(q.dtype)
    # The blocks are not a Python loop: their number follows the list width, min(S, W) + ..., which
    # is symbolic in a traced program, and a loop unrolled at one width is wrong at another (padding
    # to whole blocks, or a tensor over the blocks, would make the trace guard on the width instead).
    # The running max after an entry's block is the running max over the entries up to the block's
    # last one, seeded at -1e30 as the kernel's. Each entry's probability is taken against it and
    # rounded to bf16 for the value product; the later blocks' rescalings of a block's sums,
    # exp(m_j - m_j+1) ... exp(m_-2 - m_-1), are applied at once as exp(m_j - m_-1).
    block_end = (torch.arange(k, device=q.device) // SPARSE_ATTN_BLOCK + 1) * SPARSE_ATTN_BLOCK - 1
    m = torch.cummax(logits, dim=-1).values.index_select(-1, block_end.clamp(max=k - 1)).clamp(min=-1e30)
    last = logits.amax(dim=-1).clamp(min=-1e30)
    carry = torch.exp(m - last.unsqueeze(-1))
    p = torch.exp(logits - m)
    den = (p * carry).sum(dim=-1)
    acc = torch.einsum("bshk,bskd->bshd", p.to(q.dtype).float() * carry, rows.float())
    return (acc / (den + torch.exp(sink - last)).unsqueeze(-1)).to(q.dtype)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Indexer scores [B,S,N] = sum over heads h of relu(q[b,s,h] . keys[b,t]) * w[b,s,h] (spec
    §6.5(d)), in torch's ops on the inputs' dtype: bf16 matmul, relu, product, sum over heads."""
    scores = torch.einsum("bshd,btd->bsht", q, keys)
    return (scores.relu() * w.unsqueeze(-1)).sum(dim=2)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim (unordered).

    bf16 (the reference's dtype): torch's `topk(sorted=False)`, whose tie-breaking the reference
    has and which depends on the tensor's width, so prefill and decode may pick different members
    of a tie (spec §6.5). fp32 (the exact twin): ties go to the lower index, independent of the
    width, so prefill and prefill+decode select the same entries.
    """
    if scores.dtype == torch.float32:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        # the first k by a gather: a cut [..., :k] is contiguous only where the width is k, and a
        # traced batched decode step would guard on the width reaching k
        return order.index_select(-1, torch.arange(k, device=scores.device))
    return scores.topk(k, dim=-1, sorted=False).indices


def pad_to(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`scores` with -inf columns appended up to at least k columns, so that a top-k list always has
    k entries (-inf ones end up -1 or unselected). Selecting from the padded scores gives the same
    set as a top-min(k, n) list, but the list's width no longer depends on the number of entries:
    a traced decode step needs no guard on the position against k (one graph for every position)."""
    n = scores.shape[-1]
    return F.pad(scores, (0, torch.sym_max(n, k) - n), value=float("-inf"))


# ------------------------------------------------------------------------------------ window lists
def prefill_window_index(seqlen: int, window: int, device: torch.device) -> torch.Tensor:
    """[S, min(S,W)]: positions max(0,t-W+1)..t ascending, then -1 padding (rows of the chunk)."""
    t = torch.arange(seqlen, device=device).unsqueeze(1)
    idx = (t - window + 1).clamp(min=0) + torch.arange(min(seqlen, window), device=device)
    return torch.where(idx <= t, idx, -1).int()


def decode_window_index(pos: int, window: int, device: torch.device) -> torch.Tensor:
    """[W]: ring slots oldest first, (pos mod W)+1 .. W-1, 0 .. pos mod W; slots > pos are -1."""
    slots = (torch.arange(window, device=device) + pos + 1) % window
    return torch.where(slots > pos, -1, slots).int()


def compress_len(state: CallState, ratio: int, device: torch.device) -> torch.Tensor:
    """Compressed entries visible to each query of the call: floor((t+1)/rho), [S] int64."""
    t = torch.arange(state.start_pos, state.start_pos + state.seqlen, device=device)
    return (t + 1) // ratio


def write_window(cache: LayerCache, kv: torch.Tensor, state: CallState) -> None:
    """Seed (prefill: the last min(S,W) positions) or update (decode) the ring, slot t mod W."""
    w = cache.window.rows
    n = min(state.seqlen, w)
    pos = torch.arange(state.start_pos + state.seqlen - n, state.start_pos + state.seqlen, device=kv.device)
    cache.window.write(pos % w, kv[:, -n:])


# ------------------------------------------------------------------------------------ compressor
class Compressor(nn.Module):
    """Turns every completed group of rho tokens into one latent (before RoPE), spec §6.4.

    rho = 1: norm(wkv(x)), bf16, no gate.  rho >= 2: fp32 values and gate scores, a per-channel
    softmax over the group's rho tokens, pooled, cast to the compute dtype, then normalised.
    """

    def __init__(self, args: ModelArgs, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        d = args.head_dim
        wdtype = torch.float32 if ratio >= 2 else dtype
        self.wkv = Linear(args.dim, d, "dense", wdtype)
        if ratio >= 2:
            self.wgate = Linear(args.dim, d, "dense", wdtype)
        self.norm = RMSNorm(d, args.norm_eps, dtype)

    def forward(self, x: torch.Tensor, state: CallState, cache: LayerCache) -> tuple[torch.Tensor, int]:
        """Returns (latents [B, n_new, d_h], first group index g0). Prefill: the completed groups
        (n_new may be 0); decode: always one entry, that of the token's group (see below)."""
        rho = self.ratio
        if rho == 1:
            return self.norm(self.wkv(x)), state.start_pos
        a, s = self.wkv(x.float()), self.wgate(x.float())
        b = x.shape[0]
        if state.is_prefill:
            groups = state.seqlen // rho
            # The open group's tokens go to their slots (position % rho) of the group buffer. Written
            # as the last rho positions (those before 0 replaced by 0), whatever the remainder: a slot
            # of a completed group is stale, as in decode, and is overwritten before its group's entry
            # is seen; a copy of remainder-many rows would guard on the remainder being 0 (one graph
            # per residue). A `where`, not a clamp: Inductor turns a clamped index into a sympy Max,
            # whose simplification fails on its loop variable (torch 2.13's AOTInductor: "vr must not
            # be None for symbol q0").
            last = torch.arange(rho, device=x.device) + (state.seqlen - rho)
            last = torch.where(last < 0, 0, last)
            slots = last % rho
            cache.group_kv[:b].index_copy_(1, slots, a.index_select(1, last))
            cache.group_score[:b].index_copy_(1, slots, s.index_select(1, last))
            a, s = a[:, :groups * rho].unflatten(1, (groups, rho)), s[:, :groups * rho].unflatten(1, (groups, rho))
            g0 = 0
        else:
            # The token joins its group's buffer and the group's entry is pooled at every step, so
            # a decode step is one graph at every position (no branch on the position within the
            # group). Before the group's last token the pooled entry mixes in the previous group's
            # stale rows; it goes to row start_pos // rho, which no query sees until the group is
            # complete (compress_len), and the completing step writes that row again.
            slot = (torch.arange(1, device=x.device) + state.start_pos) % rho     # a tensor: no guard
            cache.group_kv[:b].index_copy_(1, slot, a)
            cache.group_score[:b].index_copy_(1, slot, s)
            a, s = cache.group_kv[:b].unsqueeze(1), cache.group_score[:b].unsqueeze(1)
            g0 = state.start_pos // rho
        pooled = (a * torch.softmax(s, dim=2)).sum(dim=2)
        return self.norm(pooled.to(x.dtype)), g0


# ------------------------------------------------------------------------------------ indexer
class Indexer(nn.Module):
    """Scores compressed entries for each query and publishes the top-k list (spec §6.5, §6.9)."""

    def __init__(self, args: ModelArgs, role: LayerRole, dtype: torch.dtype, kv_quant: bool):
        super().__init__()
        self.role, self.kv_quant = role, kv_quant
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.block_size, self.topk_blocks = args.candidate_block_size, args.candidate_topk_blocks
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, weight_format(args.dtype), dtype)
        self.weights_proj = Linear(args.dim, self.n_heads, "dense", dtype)
        if role.owns_index_keys:
            self.wk = Linear(args.head_dim, self.head_dim, "dense", dtype)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps, dtype)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def _fq(self, x: torch.Tensor) -> torch.Tensor:
        return quant.fp4_ue8m0_fake_quant(x, 32) if self.kv_quant else x

    def write_keys(self, latents: torch.Tensor, g0: int, rope: torch.Tensor, cache: LayerCache) -> None:
        """Index keys from the un-rotated, un-quantised latents of groups g0, g0+1, ..."""
        n = latents.shape[1]
        k = self._fq(apply_rope(self.k_norm(self.wk(latents)), rope))
        cache.index_keys.write(slice(g0, g0 + n), k)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, state: CallState, keys: torch.Tensor,
                rope: torch.Tensor, n_window: int) -> torch.Tensor:
        """Top-k compressed rows per query, offset by n_window, -1 for invisible: [B,S,K_I] int32.
        The spec's list has k' = min(K_I, n_c) entries; the slots past k' are -1 here (the same
        selection, a width that does not depend on the position)."""
        b, s, _ = x.shape
        ratio, n_c = self.role.ratio, keys.shape[1]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = self._fq(apply_rope(q, rope))
        w = self.weights_proj(x) * self.weight_scale
        scores = index_scores(q, keys, w)
        visible_len = compress_len(state, ratio, x.device)                     # [S]
        if state.is_prefill:
            invisible = torch.arange(n_c, device=x.device) >= visible_len.unsqueeze(1)
            scores = scores.masked_fill(invisible, float("-inf"))
        if self.role.is_candidate_source:
            state.candidates = self.candidate_mask(scores, visible_len)
        elif self.role.uses_candidates:
            scores = scores.masked_fill(~state.candidates, float("-inf"))
        idx = top_indices(pad_to(scores, self.topk), self.topk).sort(dim=-1).values
        idx = torch.where(idx >= visible_len.view(1, s, 1), -1, idx + n_window)
        return idx.int()

    def candidate_mask(self, scores: torch.Tensor, visible_len: torch.Tensor) -> torch.Tensor:
        """Keep the best blocks of `block_size` entries per query, the newest one pinned (§6.9)."""
        n = scores.shape[-1]
        bs = self.block_size
        n_blocks = -(-n // bs)
        padded = F.pad(scores, (0, n_blocks * bs - n), value=float("-inf"))
        block = padded.unflatten(-1, (n_blocks, bs)).amax(dim=-1)
        newest = (visible_len - 1).div(bs, rounding_mode="floor")             # -1: nothing to pin
        pin = (torch.arange(n_blocks, device=scores.device) == newest.unsqueeze(1)).expand_as(block)
        block = block.masked_fill(pin, float("inf"))
        block = pad_to(block, self.topk_blocks)
        top = top_indices(block, self.topk_blocks)
        keep = torch.zeros_like(block, dtype=torch.bool).scatter(-1, top, True) & (block > float("-inf"))
        # entry t keeps its block's flag; a gather rather than repeat_interleave and a cut to n, whose
        # contiguity depends on n % bs: a traced decode step would guard on it and recompile
        return keep[..., torch.arange(n, device=scores.device) // bs]


# ------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    """Multi-query latent attention over the sliding window plus (rho > 0) the compressed KV."""

    def __init__(self, args: ModelArgs, role: LayerRole, dtype: torch.dtype, kv_quant: bool):
        super().__init__()
        self.role, self.kv_quant = role, kv_quant
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.window, self.groups, self.o_rank = args.window_size, args.o_groups, args.o_lora_rank
        self.scale = self.head_dim ** -0.5
        fmt = weight_format(args.dtype)
        self.attn_sink = nn.Parameter(torch.empty(args.n_heads, dtype=torch.float32))
        self.wq_a = Linear(args.dim, args.q_lora_rank, fmt, dtype)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps, dtype)
        self.wq_b = Linear(args.q_lora_rank, args.n_heads * args.head_dim, fmt, dtype)
        self.wkv = Linear(args.dim, args.head_dim, fmt, dtype)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps, dtype)
        self.wo_a = Linear(args.n_heads * args.head_dim // args.o_groups, args.o_groups * args.o_lora_rank,
                           "dense", torch.bfloat16 if dtype == torch.bfloat16 else dtype)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.dim, fmt, dtype)
        if role.is_kv_source:
            self.compressor = Compressor(args, role.ratio, dtype)
        if role.is_index_source:
            self.indexer = Indexer(args, role, dtype, kv_quant)
        self.rope_key = "compressed" if role.ratio > 0 else "swa"

    def query(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return apply_rope(q, rope), qr

    def window_kv(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        kv = apply_rope(self.kv_norm(self.wkv(x)), rope)
        return quant.fp8_fake_quant(kv, 32) if self.kv_quant else kv

    def output(self, o: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, then the block-diagonal wo_a per group and wo_b (spec §6.10)."""
        o = apply_rope(o, rope, inverse=True)
        b, s = o.shape[:2]
        o = o.reshape(b, s, self.groups, -1)
        wa = self.wo_a.weight.view(self.groups, self.o_rank, -1)
        u = torch.einsum("bsgd,grd->bsgr", o.to(wa.dtype), wa).to(o.dtype)
        return self.wo_b(u.flatten(2))

    def forward(self, x: torch.Tensor, state: CallState) -> torch.Tensor:
        rope = state.rope[self.rope_key][state.positions()]
        cache = state.cache.layers[self.role.layer_id]
        q, qr = self.query(x, rope)
        kv = self.window_kv(x, rope)
        write_window(cache, kv, state)
        if state.is_prefill:
            kv_rows = kv
            idx = prefill_window_index(state.seqlen, self.window, x.device).expand(state.batch, -1, -1)
        else:
            kv_rows = cache.window.read(state.batch)
            idx = decode_window_index(state.start_pos, self.window, x.device).expand(state.batch, 1, -1)
        if self.role.ratio > 0:
            kv_rows, idx = self.add_compressed(x, qr, rope, state, kv_rows, idx)
        o = sparse_attn(q, kv_rows, self.attn_sink, idx, self.scale)
        return self.output(o, rope)

    def add_compressed(self, x, qr, rope, state: CallState, kv_rows, idx):
        """Compressor -> indexer -> RoPE + FP4 of new entries -> cache -> rows 0..n_c-1 (spec §6.7)."""
        role, ratio = self.role, self.role.ratio
        table = state.rope["compressed"]
        caches = state.cache.layers
        n_c = (state.start_pos + state.seqlen) // ratio
        n_new = 0
        if role.is_kv_source:
            latents, g0 = self.compressor(x, state, caches[role.layer_id])
            n_new = latents.shape[1]
            entry_rope = table[g0 * ratio:(g0 + n_new) * ratio:ratio] if n_new else None
            if n_new and role.owns_index_keys:
                self.indexer.write_keys(latents, g0, entry_rope, caches[role.layer_id])
        if role.is_index_source:
            if n_c > 0:
                key_cache = caches[role.kv_source].index_keys.read(state.batch, n_c)
                state.topk[role.layer_id] = self.indexer(x, qr, state, key_cache, rope, kv_rows.shape[1])
            else:
                state.topk[role.layer_id] = idx.new_zeros(state.batch, state.seqlen, 0)
        if n_new:
            entries = apply_rope(latents, entry_rope)
            store = caches[role.layer_id].kv
            # a packed store quantises what it is given and reads back its fake quant; quantising
            # the fake-quantised entries again is not the identity for FP4 with E4M3 scales
            if self.kv_quant and store.fmt is None:
                entries = quant.fp4_e4m3_fake_quant(entries, 16)
            store.write(slice(g0, g0 + n_new), entries)
        compressed = caches[role.kv_source].kv.read(state.batch, n_c)
        return torch.cat([kv_rows, compressed], dim=1), torch.cat([idx, state.topk[role.index_source]], dim=-1)


class DSparkAttention(Attention):
    """Ratio-0 attention of a DSpark stage (spec §9.3).

    Prefill only seeds the ring from the backbone-derived main_x. In decode the beta draft queries
    (positions p0+1 .. p0+beta) see ring slots 0..min(W, p0+1)-1 and all draft slots.
    """

    def forward(self, x: torch.Tensor | None, state: CallState) -> torch.Tensor | None:
        """Write main_kv of the call's positions into the ring; with draft inputs x [B, beta, D]
        (decode), attend and return [B, beta, D]."""
        table = state.rope["swa"]
        cache = state.cache.layers[self.role.layer_id]
        main_kv = self.window_kv(state.main_x, table[state.positions()])
        write_window(cache, main_kv, state)
        if x is None:
            return None
        beta = x.shape[1]
        rope = table[state.positions(1, beta)]
        q, _ = self.query(x, rope)
        kv_rows = torch.cat([cache.window.read(state.batch), self.window_kv(x, rope)], dim=1)
        n_ring = min(self.window, state.start_pos + 1)
        lst = torch.cat([torch.arange(n_ring, device=x.device),
                         torch.arange(self.window, self.window + beta, device=x.device)]).int()
        o = sparse_attn(q, kv_rows, self.attn_sink, lst.expand(state.batch, beta, -1), self.scale)
        return self.output(o, rope)
