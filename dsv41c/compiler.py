"""`dsv41c.compile`: the eager model through Dynamo (fullgraph) and AOT autograd to the post-grad aten
graph, where our pass pipeline runs as Inductor's `post_grad_custom_post_pass`.

Weights are frozen (Inductor `freezing`), so passes see them as constants and can rewrite them once
at compile time; CPU weight prepacking is off so the GEMMs stay visible as `aten.mm`. Sequence
length and position are dynamic; float module attributes (eps, limits) are specialised, as they are
hyperparameters. The compiled callable has the model's signature and shares its caches.

Two backends run the same front half (Dynamo, AOT autograd with Inductor's decompositions, freezing,
Inductor's joint-graph and post-grad passes with our pipeline among them):

- "inductor" (the default): Inductor then generates code (C++ on CPU, Triton on CUDA). A whole-model
  graph takes minutes of code generation on a CPU core.
- "passes_only": the rewritten post-grad aten graph is executed directly as an FX GraphModule, with
  no Inductor code generation. It is a faithful, fast check of what the passes did (op counts and
  numerics of the very graph Inductor would lower); it is not faster than eager.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from dsv41c.errors import InputError, unwrapped
from dsv41c.model import Transformer
from dsv41c.moe import Experts
from dsv41c.passes import provenance
from dsv41c.passes.manager import GraphPass, PassPipeline, PassStats, build_pipeline

DEFAULT_PASSES = ("fuse_wqa_wkv",)
BACKENDS = ("inductor", "passes_only")
aten = torch.ops.aten


# Inductor settings that avoid Inductor bugs the model's graphs hit (the benchmark's plain
# torch.compile gets them too, so the comparison stays like for like):
# - triton.coalesce_tiling_analysis: torch 2.11's analysis asserts in tiling_utils.get_pw_red_splits
#   on the batch-32 decode graph (dynamic shapes) on an H200.
# - triton.autotune_at_compile_time: with the C++ wrapper (cpp_wrapper, AOTInductor) Inductor
#   autotunes the Triton kernels while compiling, on random tensors; a gather whose index is computed
#   upstream (the Engram hash rows, the indexer's candidate blocks) then trips Inductor's device-side
#   bounds assert, which kills the CUDA context (seen on an H200, in export and with cpp_wrapper).
#   Off, the configs are picked on the first real call's inputs (the Python wrapper's way).
INDUCTOR_WORKAROUNDS = {"triton.coalesce_tiling_analysis": False, "triton.autotune_at_compile_time": False}

# Inductor settings for the C++ wrapper only (AOTInductor's packages, and `cpp_wrapper=True`):
# - triton.persistent_reductions: an AOTInductor package of tiny's first four layers at bench.json's
#   widths (bf16, an H200) computed logits 0.336 from eager, where the same exported program under
#   torch.compile's Python wrapper was 0.006; the first kernel whose output differs between the
#   package's C++ run and AOTInductor's own Python first pass is a persistent reduction (attention's
#   softmax). Off, the package is 0.0067 (BENCHMARKS.md, cold start). Applied to `cpp_wrapper=True`
#   as well, since it launches the kernels the same way; not measured there. Triton only.
CPP_WRAPPER_WORKAROUNDS = {"triton.persistent_reductions": False}


@functools.cache
def aoti_has_shim(op: str, device_type: str) -> bool:
    """Whether the installed torch's C++ wrapper code (AOTInductor, `cpp_wrapper`) declares a C shim
    for aten `op` on `device_type`. Inductor's codegen emits a shim call for every op it knows one
    for, but the headers a torch build ships can lack one (torch 2.11's CUDA shims have no
    `_grouped_mm`: the generated code then fails to compile, seen on an H200 in both)."""
    header = (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "inductor" / "aoti_torch" / "generated"
              / f"c_shim_{device_type}.h")
    try:
        return f"aoti_torch_{device_type}_{op}(" in header.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def experts_without_shim(model: Transformer) -> list[Experts]:
    """The model's expert modules, if the C++ wrapper code for its device has no `_grouped_mm` shim
    (for those, `opaque_grouped_mm`), else none."""
    if aoti_has_shim("_grouped_mm", model.device.type):
        return []
    return [m for m in model.modules() if isinstance(m, Experts)]


@contextlib.contextmanager
def opaque_grouped_mm(experts: Sequence[Experts]) -> Iterator[None]:
    """`experts` run their grouped GEMMs through the opaque `dsv41c::grouped_mm` (bit-identical;
    called through the dispatcher from C++) while the context is open; the class default after."""
    for m in experts:
        m.opaque_grouped_mm = True
    try:
        yield
    finally:
        for m in experts:
            m.__dict__.pop("opaque_grouped_mm", None)


# Inductor keeps a fused kernel's intermediates in fp32 where eager rounds each op's output to the
# model's dtype. For a bf16 model that is not "more accurate": values rounded in one kernel and not
# in another (a cache row stored in bf16, the same row used fresh in fp32) drift apart. Measured on
# tiny's first four layers in bf16 (CPU, a 24-token prefill, relative max-abs of the logits):
# compiled vs eager 0.034 and vs the fp32 twin 0.029 (DESIGN.md: 2e-2) without emulation; with it,
# bit-identical to eager (0.0) and 0.0076 from fp32, eager's own figure. No effect on fp32 models.
# What is left on the CPU past those layers (all of tiny: 0.0032 from eager from its sixth layer on;
# bench.json's topology at tiny's widths: 0.011, against eager's own 0.027 from fp32) is not where
# the roundings sit: Inductor decomposes the fp32 softmaxes (mHC's comb, the compressor's pooling)
# into exp, sum and divide, whose last fp32 bit can differ from eager's softmax kernel, and a later
# bf16 rounding now and then shows it. Found by bisecting Inductor's decomposition table under
# aot_autograd without code generation: `aten._softmax` alone gives the whole difference.
PRECISION = {"emulate_precision_casts": True}

# Inductor settings of a decode graph with `cudagraphs=True` (experimental). A decode step is
# host-bound (hundreds of launches a step), and the position (a SymInt) sets the shapes of the
# cache reads, so the step cannot be one CUDA graph (each position would record another). Inductor's
# graph partitioning splits the step at every op whose shapes use the position: the cache writes
# and reads, the copy of RoPE's rows at the position (`copy_position_rows`), the indexer and sparse
# attention, which run as usual; the partitions between them (mHC, the projections, RoPE, the MoE,
# the head) are recorded by the CUDA graph trees and replayed. The batch stays symbolic, as in the
# compile without graphs (`dynamic=True`), so one decode graph serves every batch size above 1
# (Dynamo specialises batch 1) and the trees record each partition once per batch size. The decode
# graph is the one without graphs, with the row copies (exact) added, and so are its logits (on an
# H200: bit-identical at batch 1; at batch 32 bit-identical before the copies were added and within
# 1e-4 with them, likely from the kernels fused around the copies; BENCHMARKS.md). Inductor's
# own test of "uses a symbol" needs `partition_on_shape_symbols`. Partition reordering is off: in
# the CPU emulation it merged no partitions (32 either way at batch 2).
CUDAGRAPH_OPTIONS = {"triton.cudagraphs": True, "graph_partition": True,
                     "triton.cudagraph_skip_dynamic_graphs": True,
                     "triton.reorder_for_reducing_graph_partitions": False}
_DYNAMIC = "dynamic shape ops"  # Inductor's partition reason for a node that uses a symbol


@torch.library.custom_op("dsv41c::table_rows", mutates_args=())
def table_rows(table: torch.Tensor, start: int, length: int, step: int) -> torch.Tensor:
    """table[start : start + length * step : step], copied: a constant table's rows at a position."""
    return table[start:start + length * step:step].clone()


@table_rows.register_fake
def _(table, start, length, step):
    return table.new_empty((length, *table.shape[1:]))


def copy_position_rows(graph: fx.Graph) -> int:
    """Replace each slice of a constant (a frozen buffer such as RoPE's tables) along dim 0 at a
    symbolic start and of a static length by one `dsv41c::table_rows` copy; returns the count.

    In the decode graph the position picks RoPE's rows: every kernel reading them through the slice
    indexes memory with the position's symbol, so the partition rule kept each out of the CUDA
    graphs, and with it the concatenation it writes into (BENCHMARKS.md). After the copy only the
    copy takes the position; the kernels read its rows at fixed offsets. A copy, so the values are
    the same bits."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
            continue
        src, dim, start, _, step = (*node.args, *(None, 0, None, None, 1)[len(node.args):])
        length = node.meta["val"].shape[0] if "val" in node.meta else None
        if (getattr(src, "op", None) != "get_attr" or dim != 0 or not isinstance(start, fx.Node)
                or not isinstance(length, int) or not isinstance(step, int) or node.kwargs):
            continue
        with graph.inserting_before(node):
            rows = graph.call_function(torch.ops.dsv41c.table_rows.default, (src, start, length, step))
        rows.meta.update(node.meta)
        node.replace_all_uses_with(rows)
        graph.erase_node(node)
        count += 1
    return count


class PartitionRuleKey(CustomGraphPass):
    """The graphed compile's post-grad pre-pass: `copy_position_rows`. Its uuid, a hash of this
    file, also keys Inductor's caches on the partition rule of `partition_on_shape_symbols`, which
    Inductor's own cache key cannot see (a graph partitioned by another rule would otherwise be
    reused)."""

    def __call__(self, graph: fx.Graph) -> None:
        copy_position_rows(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


@contextlib.contextmanager
def partition_on_shape_symbols() -> Iterator[None]:
    """While active, Inductor's graph partitioner takes a node as dynamic only if it uses a symbol
    of the shape environment (a size or an unbacked value) other than the batch's, and graphs a node
    that writes into another buffer's memory only as part of a whole concatenation group.

    Inductor (torch 2.11-2.13) counts a node's own loop index and temporary symbols (`d0`, `i0`,
    `tmp0`, ...) among its symbol uses, so nearly every computed buffer came out dynamic: on an H200,
    312 of 352 nodes of a 4-layer decode graph stayed out of the graphs. Counting the shape symbols
    only (with those in the node's memory indexing, where an index_put's row from the position
    shows), a concatenation was split: its pieces are written straight into its buffer, which was
    then allocated on one side of a partition boundary and written on the other (wrong and NaN
    logits). So in-place mutations and writes to graph inputs stay out of the graphs, and a
    concatenation is graphed together with the kernels that write its pieces, in one partition, or
    not at all (BENCHMARKS.md, "CUDA graphs of the decode step").

    The batch's symbols (those in the sizes and strides of the graph's tensor inputs: the decode
    ids; the caches' shapes are static) do not make a node dynamic: a CUDA graph tree records each
    partition once per batch size."""
    from torch._inductor import ir
    from torch._inductor.dependencies import MemoryDep
    from torch._inductor.virtualized import V
    from torch._inductor.scheduler import FusedSchedulerNode, Scheduler, get_scheduler_node_symbol_uses
    from torch.utils._sympy.symbol import SymT, symbol_is_type
    inner = Scheduler.should_partition
    shape = (SymT.SIZE, SymT.FLOAT, SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)

    def uses_shape_symbol(node) -> bool:
        # the symbols of its buffers and arguments, and those its loops index memory with (an
        # index_put's row from the position shows only there)
        syms = set(get_scheduler_node_symbol_uses(node))
        for dep in (*node.read_writes.reads, *node.read_writes.writes):
            if isinstance(dep, MemoryDep):
                for expr in (dep.index, *dep.size):
                    syms |= getattr(expr, "free_symbols", set())
        body = getattr(node, "_body", None)
        for expr in getattr(body, "indexing_exprs", {}).values():
            syms |= expr.free_symbols
        syms -= batch_symbols()
        return any(symbol_is_type(s, shape) for s in syms)

    batch: dict = {}

    def batch_symbols() -> set:
        """The symbols in the sizes and strides of the graph's tensor inputs, once per graph."""
        if batch.get("graph") is not V.graph:
            found = set()
            for value in V.graph.graph_inputs.values():
                if isinstance(value, ir.IRNode):
                    for expr in (*value.get_size(), *(value.maybe_get_stride() or ())):
                        found |= getattr(expr, "free_symbols", set())
            batch.update(graph=V.graph, symbols=found)
        return batch["symbols"]

    def writes_another_buffer(node) -> bool:
        ir_node = node.node
        layout = getattr(ir_node, "layout", None)
        return (isinstance(ir_node, ir.ConcatKernel)
                or isinstance(layout, (ir.NonOwningLayout, ir.MutationLayoutSHOULDREMOVE))
                or any(dep.name in V.graph.graph_inputs for dep in node.read_writes.writes))

    def should_partition(self, node):
        reason = inner(self, node)  # (a fused node: this function on each of its nodes)
        if reason in (None, _DYNAMIC) and not isinstance(node, FusedSchedulerNode) and writes_another_buffer(node):
            if not in_a_graphed_group(self, node):
                return "writes into another buffer"
            reason = None
        return None if reason == _DYNAMIC and not uses_shape_symbol(node) else reason

    plans: dict = {}

    def in_a_graphed_group(self, node) -> bool:
        """Whether node belongs to a concatenation group (the ConcatKernel and the kernels writing
        into its buffer) that may be graphed as a whole, in one partition."""
        names = (id(self), *(n.get_name() for n in self.nodes))
        if plans.get("names") != names:
            plans.update(names=names, graphed=graphed_groups(self))
        return node.get_name() in plans["graphed"]

    def graphed_groups(self) -> set:
        """Names of the scheduler nodes of the concatenation groups that can be graphed: no member is
        kept out for another reason, and no node between the first and the last member in the
        schedule is kept out (so one partition holds the buffer and every write into it)."""
        at, groups, cats, out = {}, {}, set(), set()   # groups: the buffer written into -> node names
        for i, top in enumerate(self.nodes):
            for n in top.get_nodes():
                at[n.get_name()] = i
                layout = getattr(n.node, "layout", None)
                if isinstance(n.node, ir.ConcatKernel):
                    cats.add(n.node.get_name())
                    groups.setdefault(n.node.get_name(), set()).add(n.get_name())
                elif isinstance(layout, ir.NonOwningLayout) and isinstance(layout.view, ir.ReinterpretView):
                    groups.setdefault(layout.view.data.get_name(), set()).add(n.get_name())
                elif isinstance(layout, ir.MutationLayoutSHOULDREMOVE) or any(
                        dep.name in V.graph.graph_inputs for dep in n.read_writes.writes):
                    out.add(i)
                    continue
                reason = inner(self, n)
                if reason is not None and not (reason == _DYNAMIC and not uses_shape_symbol(n)):
                    out.add(i)
        graphed = {name: {at[m] for m in groups[name]} for name in cats}
        changed = True
        while changed:                           # a group kept out can fall inside another's span
            changed = False
            for name, spots in list(graphed.items()):
                if any(i in out for i in range(min(spots), max(spots) + 1)):
                    out |= spots
                    del graphed[name]
                    changed = True
        return {m for name in graphed for m in groups[name]}
    Scheduler.should_partition = should_partition
    try:
        yield
    finally:
        Scheduler.should_partition = inner


def inductor_options(pipeline) -> dict:
    options = {**INDUCTOR_WORKAROUNDS, **PRECISION, "freezing": True, "cpp.weight_prepack": False,
               "post_grad_custom_post_pass": pipeline}
    for p in pipeline.passes:                  # what a pass needs of Inductor (GraphPass.inductor_config)
        options.update(p.inductor_config)
    return options


# ------------------------------------------------------------------------------ backends
def _post_grad_only(gm: fx.GraphModule, example_inputs, **kwargs: Any):
    """An Inductor `inner_compile` that stops after the post-grad passes: the same preparation as
    Inductor's own (view -> reshape, fake-tensor propagation, `_recursive_post_grad_passes`, which
    runs our pipeline), then the GraphModule itself is the compiled function. Private torch API,
    pinned by the torch version range in pyproject.toml."""
    from torch._inductor.compile_fx import (
        _recursive_post_grad_passes,
        fake_tensor_prop,
        view_to_reshape,
    )
    from torch._inductor.virtualized import V
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():             # as compile_fx_inner: passes build real constants
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode):
            _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", True))
        gm.recompile()

    def run(args: list) -> Any:
        inputs = list(args)
        args.clear()                           # boxed calling convention: the callee owns the list
        return gm(*inputs)

    run._boxed_call = True
    return run


def dynamo_backend(name: str):
    """The Dynamo backend of `name` (one of BACKENDS); the Inductor config in effect applies."""
    from torch._inductor.compile_fx import compile_fx
    if name == "inductor":
        return compile_fx
    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=_post_grad_only)


# ------------------------------------------------------------------------------ op counts
@dataclass(frozen=True)
class OpCounts:
    """Ops of one post-grad aten graph.

    gemms: aten.mm and aten.addmm (the projections); batched_gemms: aten.bmm (einsum contractions:
    attention scores and values, grouped wo_a, routed experts); mhc: call_function nodes traced
    from dsv41c/mhc.py (mixes, the Sinkhorn's sum/div chain, collapse, expand); cache_writes: aten.copy_
    into a graph input (the write-back of a functionalised in-place cache update); nodes: every
    call_function node.
    """
    gemms: int = 0
    batched_gemms: int = 0
    mhc: int = 0
    cache_writes: int = 0
    nodes: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


GEMM_OPS = (aten.mm.default, aten.addmm.default)
MHC_SOURCE = "dsv41c/mhc.py"


def _traced_from(node: fx.Node) -> str:
    """The file of a node's innermost source frame, '' if unknown."""
    frames = provenance.frames(node)
    return frames[-1][0].replace("\\", "/") if frames else ""


def module_path(node: fx.Node) -> str:
    """The model submodule a node was traced in ("layers.3.attn.wq_a"), else that of its first input
    that has one (nodes a pass creates carry no source of their own); "" if none."""
    while node is not None:
        if node.meta.get("nn_module_stack"):
            return provenance.module_of(node)
        node = next(iter(node.all_input_nodes), None)
    return ""


def gemm_modules(graph: fx.Graph) -> tuple[str, ...]:
    """`module_path` of every GEMM node, in graph order."""
    return tuple(module_path(n) for n in graph.nodes if n.op == "call_function" and n.target in GEMM_OPS)


def count_ops(graph: fx.Graph) -> OpCounts:
    gemms = bmm = mhc = writes = nodes = 0
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        nodes += 1
        gemms += n.target in GEMM_OPS
        bmm += n.target is aten.bmm.default
        mhc += _traced_from(n).endswith(MHC_SOURCE)
        writes += n.target is aten.copy_.default and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
    return OpCounts(gemms, bmm, mhc, writes, nodes)


# ------------------------------------------------------------------------------ observation
@dataclass
class GraphSnapshot:
    """One compiled graph as a stage left it: stage is "input" (the post-grad graph handed to the
    pipeline) or the name of the pass just run; gemms: `module_path` of each GEMM."""
    graph: int
    stage: str
    counts: OpCounts
    gemms: tuple[str, ...]
    code: str | None = None


class ObservedPass(GraphPass):
    """Runs `inner` and records the graph before it (first pass only) and after it."""

    def __init__(self, inner: GraphPass, log: list[GraphSnapshot], first: bool, keep_code: bool):
        super().__init__(**inner.options)
        self.inner, self.log, self.first, self.keep_code = inner, log, first, keep_code
        self.name = inner.name
        self.inductor_config = inner.inductor_config  # what the pass needs of Inductor (online softmax off)
        self.graphs = 0

    def _record(self, graph: fx.Graph, stage: str) -> None:
        code = graph.owning_module.print_readable(print_output=False) if self.keep_code else None
        self.log.append(GraphSnapshot(self.graphs, stage, count_ops(graph), gemm_modules(graph), code))

    def apply(self, graph: fx.Graph) -> PassStats:
        self.graphs += 1
        if self.first:
            self._record(graph, "input")
        stats = self.inner.apply(graph)
        self._record(graph, self.name)
        return stats


# ------------------------------------------------------------------------------ compiled model
class CompiledModel:
    """Same call surface as `Transformer.forward`; `pipeline.stats` holds the pass statistics of
    the graphs compiled in this process (an Inductor cache hit, keyed by the pipeline's uuid, reuses
    the rewritten graph without running the passes again; `observe` turns that cache off).

    observe: record `snapshots` (op counts of every graph before the passes and after each one);
    keep_code: also keep each snapshot's readable graph code (large); cpp_wrapper: Inductor's C++
    wrapper instead of its Python one (fewer host microseconds per kernel launch, a longer compile);
    cudagraphs: decode steps replay CUDA graphs (see `CUDAGRAPH_OPTIONS`).
    """

    def __init__(self, model: Transformer, passes: Sequence[str] | None, strict: bool, backend: str = "inductor",
                 observe: bool = False, keep_code: bool = False, cpp_wrapper: bool = False,
                 cudagraphs: bool = False):
        if backend not in BACKENDS:
            raise InputError(f"backend: expected one of {BACKENDS}, found {backend!r}")
        if cudagraphs and (model.device.type != "cuda" or backend != "inductor" or cpp_wrapper):
            raise InputError(f"cudagraphs: needs a CUDA model, the inductor backend and the Python wrapper; found "
                             f"{model.device.type}, {backend}, cpp_wrapper={cpp_wrapper}")
        self.model, self.backend, self.cpp_wrapper, self.cudagraphs = model, backend, cpp_wrapper, cudagraphs
        # traced and run through `dsv41c::grouped_mm` where the C++ wrapper has no shim for the aten op
        self._opaque_experts = experts_without_shim(model) if cpp_wrapper else []
        self.pipeline = build_pipeline(passes, strict) if passes else PassPipeline([], strict)
        self.pipeline.bind(model)
        self.observe = observe or keep_code
        self.snapshots: list[GraphSnapshot] = []
        if self.observe:
            self.pipeline.passes = [ObservedPass(p, self.snapshots, i == 0, keep_code)
                                    for i, p in enumerate(self.pipeline.passes)]
        self.graphs = 0
        self.compile_seconds = 0.0
        inner = dynamo_backend(backend)

        def counting_backend(gm, example_inputs):
            self.graphs += 1
            return inner(gm, example_inputs)

        self._fn = torch.compile(model.forward, backend=counting_backend, fullgraph=True, dynamic=True)

    def _options(self, graphed: bool) -> dict:
        options = inductor_options(self.pipeline)
        if self.observe:                      # a cache hit would skip the passes being watched
            options["fx_graph_cache"] = False
        if self.cpp_wrapper:
            options.update(cpp_wrapper=True, **CPP_WRAPPER_WORKAROUNDS)
        if graphed:
            options.update(CUDAGRAPH_OPTIONS, post_grad_custom_pre_pass=PartitionRuleKey())
        return options

    def __call__(self, input_ids: torch.Tensor, start_pos: int = 0, full_logits: bool = False,
                 return_hidden: bool = False):
        self.model.check_inputs(input_ids, start_pos)          # eager-side checks (Transformer.check_inputs)
        input_ids = input_ids.to(self.model.device)            # host ids: copied here, not inside the graph
        graphed = self.cudagraphs and input_ids.shape[1] == 1
        if graphed:                                            # each call is a new step of the CUDA graph trees
            torch.compiler.cudagraph_mark_step_begin()
        args = (input_ids, start_pos, full_logits, return_hidden)
        with unwrapped():   # a pass's error (strict mode) as itself, not inside Dynamo's
            try:            # a call that a compiled graph serves needs none of the compile-time settings
                with torch.no_grad(), opaque_grouped_mm(self._opaque_experts), \
                        torch.compiler.set_stance("fail_on_recompile"):
                    out = self._fn(*args)
            except RuntimeError as e:
                if "fail_on_recompile" not in str(e):
                    raise
                out = self._compile_and_run(args, graphed)
        if graphed:  # a graph's outputs live in its memory pool, which the next step overwrites
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out

    def _compile_and_run(self, args: tuple, graphed: bool):
        """A call that needs a new graph of the forward: Dynamo traces it and Inductor compiles it
        under the pipeline's settings (about 80 us of context switching on a CPU host, which the
        calls that a compiled graph serves skip: `__call__`)."""
        input_ids, start_pos = args[:2]
        t0, graphs = time.perf_counter(), self.graphs
        with torch.no_grad(), \
                torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, specialize_float=True), \
                torch._functorch.config.patch(enable_autograd_cache=not self.observe), \
                torch._inductor.config.patch(self._options(graphed)), \
                partition_on_shape_symbols() if graphed else contextlib.nullcontext(), \
                opaque_grouped_mm(self._opaque_experts):
            try:
                out = self._fn(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit as e:
                raise InputError(
                    f"dsv41c.compile: input_ids {tuple(input_ids.shape)} at start_pos {start_pos} needs a new graph "
                    f"of the model's forward, which has reached torch._dynamo.config.recompile_limit "
                    f"({torch._dynamo.config.recompile_limit} graphs)") from e
        if self.graphs != graphs:
            self.compile_seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def compile(model: Transformer, passes: Sequence[str] | None = DEFAULT_PASSES, strict: bool = False, *,
            backend: str = "inductor", observe: bool = False, keep_code: bool = False,
            cpp_wrapper: bool = False, cudagraphs: bool = False) -> CompiledModel:
    """Compile `model` (prefill and decode steps) with the named passes; strict: a pass that matches
    nothing is an error. backend: "inductor" (code generation) or "passes_only" (the rewritten aten
    graph runs as is, see the module docstring); cpp_wrapper: Inductor's C++ wrapper code (launch
    overhead; see CompiledModel); cudagraphs: decode steps replay CUDA graphs (`CUDAGRAPH_OPTIONS`).
    Graphs compile lazily, at the first call of each shape class (prefill, decode, ...)."""
    return CompiledModel(model, passes, strict, backend, observe, keep_code, cpp_wrapper, cudagraphs)
