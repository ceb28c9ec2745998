"""Text generation: one prefill call, then one-token decode steps (greedy or Gumbel sampling)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv41c.config import ModelArgs
from dsv41c.errors import InputError
from dsv41c.model import Transformer
from dsv41c.nn import sample


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first new token comes from the prefill; each decode step yields one more.
        steps = max(len(self.new_ids) - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


def check_prompt(args: ModelArgs, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Reject a prompt the model cannot run, before any work is done."""
    a = args
    if not prompt_ids:
        raise InputError("prompt: empty (no tokens to prefill)")
    bad = [t for t in prompt_ids if not 0 <= t < a.vocab_size]
    if bad:
        raise InputError(f"prompt: token id {bad[0]} outside the vocabulary 0..{a.vocab_size - 1}")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens: must be >= 1, found {max_new_tokens}")
    total = len(prompt_ids) + max_new_tokens - 1
    if total > a.max_seq_len:
        raise InputError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens needs {total} "
                         f"positions, more than max_seq_len={a.max_seq_len}")


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, on_token: Callable[[int], None] | None = None,
             stop_ids: tuple[int, ...] = ()) -> GenerationResult:
    """Prefill `prompt_ids` (one sequence), then decode up to `max_new_tokens` tokens.

    `on_token` is called after every new token (progress display). Timings are wall-clock,
    synchronised on CUDA.
    """
    check_prompt(model.args, prompt_ids, max_new_tokens)
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.reset_cache()
    result = GenerationResult(list(prompt_ids))
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)

    t0 = time.perf_counter()
    logits = model(ids, start_pos=0)
    token = sample(logits, temperature, gen)
    sync()
    result.prefill_s = time.perf_counter() - t0
    result.new_ids.append(int(token))
    if on_token:
        on_token(result.new_ids[-1])

    t0 = time.perf_counter()
    pos = len(prompt_ids)
    while len(result.new_ids) < max_new_tokens and result.new_ids[-1] not in stop_ids:
        logits = model(token.view(1, 1), start_pos=pos)
        token = sample(logits, temperature, gen)
        result.new_ids.append(int(token))
        pos += 1
        if on_token:
            on_token(result.new_ids[-1])
    sync()
    result.decode_s = time.perf_counter() - t0
    result.text = model.tokenizer.decode(result.new_ids)
    return result
