"""DSpark draft head (spec §9): stages that are full mHC blocks with a DSpark attention, fed by
the backbone's target-layer inputs (main_x), then the Markov head and the confidence head.

Protocol (spec §9.5): after every backbone call, `draft(model, ids, main_hidden, start_pos)`.
In prefill it only seeds the stages' rings; in decode it returns the draft block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41c import mhc
from dsv41c.attention import CallState
from dsv41c.config import LayerRole, ModelArgs
from dsv41c.model import Block
from dsv41c.nn import Linear, RMSNorm, sample, uninitialised, weight_format


class DSparkStage(Block):
    """Stage j: a block (ratio-0 DSpark attention, DSpark MoE). Stage 0 owns main_proj/main_norm;
    the last stage owns norm, markov_head and confidence_head."""

    def __init__(self, args: ModelArgs, role: LayerRole, j: int, dtype: torch.dtype, kv_quant: bool):
        super().__init__(args, role, dtype, kv_quant)
        d, r, v = args.dim, args.dspark_markov_rank, args.vocab_size
        if j == 0:
            self.main_proj = Linear(d * len(args.dspark_target_layer_ids), d, weight_format(args.dtype), dtype)
            self.main_norm = RMSNorm(d, args.norm_eps, dtype)
        if j == args.n_mtp_layers - 1:
            self.norm = RMSNorm(d, args.norm_eps, dtype)
            self.markov_head = nn.Module()
            self.markov_head.embed = uninitialised(nn.Embedding, v, r, dtype=dtype)
            self.markov_head.head = uninitialised(nn.Linear, r, v, bias=False, dtype=torch.float32)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = uninitialised(nn.Linear, d + r, 1, bias=False, dtype=torch.float32)

    def forward(self, h: torch.Tensor | None, pre: torch.Tensor | None, state: CallState):
        if h is None:                       # prefill: seed the ring only, the stage is skipped
            self.attn(None, state)
            return None, None
        return super().forward(h, pre, state)


@torch.no_grad()
def draft(model, ids: torch.Tensor, main_hidden: torch.Tensor, start_pos: int,
          generator: torch.Generator | None = None):
    """ids [B]: the token the backbone just sampled; main_hidden [B, S, D*T] from the same call.

    Prefill (start_pos 0): seeds the rings, returns None. Decode: returns
    (draft ids [B, beta+1], draft logits [B, beta, V] fp32 with the Markov bias, confidence [B, beta]).
    """
    args, stages = model.args, model.mtp
    if not args.has_dspark:
        raise RuntimeError("this model has no DSpark stages (dspark_block_size = 0)")
    b, s = main_hidden.shape[:2]
    state = model.call_state(b, s, start_pos)
    state.main_x = stages[0].main_norm(stages[0].main_proj(main_hidden))
    if start_pos == 0:
        for stage in stages:
            stage(None, None, state)
        return None
    beta = args.dspark_block_size
    draft_ids = torch.full((b, beta), args.dspark_noise_token_id, dtype=torch.long, device=ids.device)
    draft_ids[:, 0] = ids
    h = model.embed(draft_ids).unsqueeze(2).expand(-1, -1, args.hc_mult, -1)
    pre = model.one_hot_pre(b, beta, h.device)
    for stage in stages:
        h, pre = stage(h, pre, state)
    last = stages[-1]
    y = mhc.hc_collapse(h, pre)
    logits = model.head(last.norm(y).float())
    out, embeds = [draft_ids[:, 0]], []
    for i in range(beta):
        e = last.markov_head.embed(out[i])
        logits[:, i] += F.linear(e.float(), last.markov_head.head.weight)
        out.append(sample(logits[:, i], args.temperature, generator))
        embeds.append(e)
    features = torch.cat([y, torch.stack(embeds, dim=1)], dim=-1).float()
    confidence = last.confidence_head.proj(features).squeeze(-1)
    return torch.stack(out, dim=1), logits, confidence
