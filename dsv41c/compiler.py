"""`dsv41c.compile`: the eager model through Dynamo (fullgraph) and Inductor, with our pass
pipeline installed as Inductor's post-grad custom pass.

Weights are frozen (Inductor `freezing`), so passes see them as constants and can rewrite them once
at compile time; CPU weight prepacking is off so the GEMMs stay visible as `aten.mm`. Sequence
length and position are dynamic. The compiled callable has the model's signature and shares its
caches.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from dsv41c.model import Transformer

DEFAULT_PASSES = ("fuse_wqa_wkv",)


def inductor_options(pipeline) -> dict:
    return {"freezing": True, "cpp.weight_prepack": False, "post_grad_custom_post_pass": pipeline}


class CompiledModel:
    """Same call surface as `Transformer.forward`; `pipeline.stats` holds the pass statistics of
    the graphs compiled in this process (an Inductor cache hit, keyed by the pipeline's uuid, reuses
    the rewritten graph without running the passes again)."""

    def __init__(self, model: Transformer, passes: Sequence[str] | None, strict: bool):
        from dsv41c.passes.manager import PassPipeline, build_pipeline
        self.model = model
        self.pipeline = build_pipeline(passes, strict) if passes else PassPipeline([], strict)
        self.compile_seconds = 0.0
        self._fn = torch.compile(model.forward, fullgraph=True, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, start_pos: int = 0, full_logits: bool = False,
                 return_hidden: bool = False):
        self.model.check_inputs(input_ids, start_pos)          # eager-side checks (values of ids)
        t0 = time.perf_counter()
        graphs = self.pipeline.graphs
        with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
                torch._inductor.config.patch(inductor_options(self.pipeline)):
            out = self._fn(input_ids, start_pos, full_logits, return_hidden)
        if self.pipeline.graphs != graphs:
            self.compile_seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def compile(model: Transformer, passes: Sequence[str] | None = DEFAULT_PASSES, strict: bool = False) -> CompiledModel:
    """Compile `model` (prefill and decode steps) with the named passes; strict: a pass that matches
    nothing is an error."""
    return CompiledModel(model, passes, strict)
