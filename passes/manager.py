"""The pass pipeline: orders graph passes, runs them on Inductor's post-grad aten graph, collects
their statistics, and hashes itself so that the compile cache is invalidated when a pass changes.

Installed as Inductor's `post_grad_custom_post_pass`, so `torch.compile` and AOTInductor export
share it. Runs wherever Inductor runs (CPU included).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from dsv41c.errors import DSV41CError
from dsv41c.passes import provenance


class PassError(DSV41CError):
    """A pass failed, or matched nothing in strict mode."""


@dataclass
class PassStats:
    name: str
    matches: int = 0
    nodes_removed: int = 0
    nodes_added: int = 0
    details: list[str] = field(default_factory=list)

    def merge(self, other: "PassStats") -> None:
        self.matches += other.matches
        self.nodes_removed += other.nodes_removed
        self.nodes_added += other.nodes_added
        self.details += other.details


class GraphPass:
    """A pass: `apply(graph)` rewrites a post-grad `torch.fx.Graph` in place and returns stats.
    `strict` is the pipeline's: a pass that can leave part of its work undone (and still be
    correct) reports it, and fails in strict mode."""

    name = "pass"
    strict = False
    # Inductor settings the pass needs while it runs (merged by dsv41c.compiler.inductor_options)
    inductor_config: dict[str, Any] = {}
    # modules of dsv41c.tilelang_kernels whose ops the rewritten graphs call. They are imported (the
    # import registers the ops) when the pass is made, not when it runs: a graph that Inductor
    # loads from its cache runs no pass, and still calls the ops.
    kernel_modules: tuple[str, ...] = ()

    def __init__(self, **options: Any):
        self.options = options
        for module in self.kernel_modules:
            importlib.import_module(f"dsv41c.tilelang_kernels.{module}")

    def apply(self, graph: torch.fx.Graph) -> PassStats:
        raise NotImplementedError

    def report_left(self, stats: PassStats, left: Sequence[str], what: str) -> None:
        """Sites the pass left as torch ops (`left`: one description each; `what` names them,
        e.g. "indexer site(s)"): an error in strict mode, else a warning and a `left:` detail each."""
        if not left:
            return
        message = f"{self.name}: {len(left)} {what} left as torch ops, first: {left[0]}"
        if self.strict:
            raise PassError(message)
        warnings.warn(message, stacklevel=3)
        stats.details += [f"left: {m}" for m in left]


class ModelPass(GraphPass):
    """A pass that reads the model being compiled (parameters, submodules): the pipeline's
    `bind(model)` gives it before tracing. These passes find the eager calls they lower by
    provenance, so they keep Inductor's online softmax off: its CUDA rewrite replaces a softmax
    with nodes that have no trace into the model (seen on an H200 splitting the Sinkhorn out of
    an mHC site)."""

    inductor_config = {"online_softmax": False}

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.model = None

    def bind(self, model: torch.nn.Module) -> None:
        self.model = model

    def bound_model(self) -> torch.nn.Module:
        if self.model is None:
            raise PassError(f"{self.name}: no model bound (dsv41c.compile binds it)")
        return self.model


class PassPipeline(CustomGraphPass):
    """Runs `passes` in order on every graph Inductor compiles; `stats` accumulates per pass."""

    def __init__(self, passes: Sequence[GraphPass], strict: bool = False):
        self.passes, self.strict = list(passes), strict
        for p in self.passes:
            p.strict = strict
        self.stats = {p.name: PassStats(p.name) for p in self.passes}
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        for p in self.passes:
            stats = p.apply(graph)
            if self.strict and stats.matches == 0:
                raise PassError(f"pass {p.name}: no match in graph {self.graphs} (strict mode)")
            self.stats[p.name].merge(stats)
        graph.eliminate_dead_code()
        graph.lint()

    def bind(self, model: torch.nn.Module) -> None:
        """Give passes that read model parameters (`bind(model)`) the model being compiled."""
        for p in self.passes:
            if hasattr(p, "bind"):
                p.bind(model)

    def uuid(self) -> str:
        """Changes when the pass list, any pass option, or any pass's source changes."""
        h = hashlib.sha256(inspect.getsource(inspect.getmodule(PassPipeline)).encode())
        h.update(inspect.getsource(provenance).encode())      # shared by the provenance passes
        for p in self.passes:
            h.update(json.dumps([p.name, p.options, self.strict], sort_keys=True, default=str).encode())
            h.update(inspect.getsource(inspect.getmodule(type(p))).encode())
        return h.hexdigest()


def registry() -> dict[str, type[GraphPass]]:
    """Known passes by name, in the order a pipeline runs them (mHC lowering first: it takes the
    mixes GEMMs into its kernels before projections are fused; fp4_kv touches only the cache codecs;
    lower_sparse_attn and lower_indexer read fp4_kv's dequantise calls of the caches)."""
    from dsv41c.passes.fp4_kv import PackedKV
    from dsv41c.passes.fuse_wqa_wkv import FuseSiblingLinears
    from dsv41c.passes.lower_indexer import LowerIndexer
    from dsv41c.passes.lower_mhc import LowerMHC
    from dsv41c.passes.lower_sparse_attn import LowerSparseAttn
    return {LowerMHC.name: LowerMHC, FuseSiblingLinears.name: FuseSiblingLinears, PackedKV.name: PackedKV,
            LowerSparseAttn.name: LowerSparseAttn, LowerIndexer.name: LowerIndexer}


def build_pipeline(names: Sequence[str], strict: bool = False, options: dict[str, dict] | None = None) -> PassPipeline:
    known = registry()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PassError(f"unknown pass {unknown[0]!r}; known passes: {sorted(known)}")
    options = options or {}
    return PassPipeline([known[n](**options.get(n, {})) for n in names], strict)
