"""The pass framework and fuse_wqa_wkv: on small graphs (one Inductor compile each), and on the
whole model through the passes_only backend, GEMMs per layer kind and numerics against eager."""

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import THREE_KINDS, record_tiny_cut
from dsv41c.passes.fuse_wqa_wkv import FuseSiblingLinears
from dsv41c.passes.manager import (
    GraphPass,
    PassError,
    PassPipeline,
    PassStats,
    build_pipeline,
)
from torch import nn

import dsv41c
from dsv41c import golden
from dsv41c.compiler import BACKENDS, ObservedPass, dynamo_backend, inductor_options

aten = torch.ops.aten


class CountGemms(GraphPass):
    """Records the number of aten.mm nodes of every graph it sees."""
    name = "count_gemms"

    def __init__(self):
        super().__init__()
        self.counts = []

    def apply(self, graph):
        self.counts.append(sum(1 for n in graph.nodes if n.target is aten.mm.default))
        return PassStats(self.name, matches=1)


class Siblings(nn.Module):
    """Three projections of one activation (like wq_a, wkv, weights_proj) and one of another."""

    def __init__(self):
        super().__init__()
        self.wq_a = nn.Linear(64, 48, bias=False)
        self.wkv = nn.Linear(64, 32, bias=False)
        self.weights_proj = nn.Linear(64, 4, bias=False)
        self.other = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = torch.rms_norm(x, (64,))
        return self.wq_a(h).relu(), self.wkv(h) * 2, self.weights_proj(h), self.other(x[..., :32])


def run(module, pipeline, *inputs):
    # no FX graph cache: a cache hit skips the post-grad passes, and these tests watch them run
    options = {**inductor_options(pipeline), "fx_graph_cache": False}
    with torch.no_grad(), torch._inductor.config.patch(options):
        return torch.compile(module, fullgraph=True)(*inputs)


def test_siblings_become_one_gemm_with_identical_numerics():
    torch._dynamo.reset()
    before, after = CountGemms(), CountGemms()
    fuse = FuseSiblingLinears()
    pipe = PassPipeline([before, fuse, after], strict=True)
    module = Siblings().eval()
    x = torch.randn(3, 7, 64)
    out = run(module, pipe, x)
    assert before.counts == [4] and after.counts == [2]
    stats = pipe.stats["fuse_wqa_wkv"]
    assert stats.matches == 1 and stats.nodes_removed == 3
    with torch.no_grad():
        ref = module(x)
    for o, r in zip(out, ref):
        assert ((o - r).abs().max() / r.abs().max()).item() < 1e-6


def test_the_fused_weight_is_a_compile_time_constant():
    torch._dynamo.reset()
    pipe = build_pipeline(["fuse_wqa_wkv"])
    seen = []

    class Inspect(GraphPass):
        name = "inspect"

        def apply(self, graph):
            gm = graph.owning_module
            for n in graph.nodes:
                if n.op == "get_attr" and n.target.startswith("_dsv41c_fused_weight"):
                    seen.append(tuple(getattr(gm, n.target).shape))
                assert n.target is not aten.cat.default      # no concatenation at run time
            return PassStats(self.name, matches=1)

    pipe.passes.append(Inspect())
    pipe.stats["inspect"] = PassStats("inspect")
    run(Siblings().eval(), pipe, torch.randn(2, 64))
    assert seen == [(64, 48 + 32 + 4)]


def test_strict_mode_fails_on_zero_matches():
    torch._dynamo.reset()
    lone = nn.Linear(8, 8, bias=False).eval()
    with pytest.raises(Exception, match="no match"):
        run(lone, build_pipeline(["fuse_wqa_wkv"], strict=True), torch.randn(2, 8))
    torch._dynamo.reset()
    relaxed = build_pipeline(["fuse_wqa_wkv"], strict=False)
    run(lone, relaxed, torch.randn(2, 8))
    assert relaxed.stats["fuse_wqa_wkv"].matches == 0


def test_pipeline_uuid_tracks_passes_options_and_source():
    base = build_pipeline(["fuse_wqa_wkv"]).uuid()
    assert build_pipeline(["fuse_wqa_wkv"]).uuid() == base
    assert build_pipeline([]).uuid() != base
    assert build_pipeline(["fuse_wqa_wkv"], options={"fuse_wqa_wkv": {"min_group": 3}}).uuid() != base
    assert PassPipeline([FuseSiblingLinears(), CountGemms()]).uuid() != base     # another source joins
    assert build_pipeline(["fuse_wqa_wkv"], strict=True).uuid() != base


def test_a_pipeline_registers_the_kernel_ops_its_graphs_call():
    """A graph Inductor loads from its cache runs no pass, yet calls the kernel ops the passes put in
    (a second process on a warm cache once failed: `torch.ops.dsv41c` had no `mhc_pre`). So making
    the passes registers the ops. In a fresh process: none registered before, all after."""
    code = """
import torch
from dsv41c.passes.manager import build_pipeline
ops = ("mhc_pre", "mhc_post_pre", "fp8_quant", "mxfp4_dequant", "sparse_attn_packed", "index_scores")
before = [hasattr(torch.ops.dsv41c, op) for op in ops]
build_pipeline(["lower_mhc", "fp4_kv", "lower_indexer", "lower_sparse_attn"])
print(before, [hasattr(torch.ops.dsv41c, op) for op in ops])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == f"{[False] * 6} {[True] * 6}", proc.stdout


def test_find_sites_absorbs_a_chain_of_untraced_nodes():
    """Nodes Inductor creates (no trace into the model) join the site they lie inside, also as a
    chain: here b = neg(a) and c = exp(b) sit between two nodes of one eager call, so the site reads
    only x and is read only through its last node. A chain that also feeds another node (d) stays
    outside, and so does its whole length."""
    from dsv41c.passes import provenance

    def graph_of(leak: bool):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(4)
        traced = 'File "/src/dsv41c/mhc.py", line 7, in f\n    y = x * 2\n'
        a = g.call_function(aten.mul.Tensor, (x, 2))
        b = g.call_function(aten.neg.default, (a,))   # untraced: no stack trace
        c = g.call_function(aten.exp.default, (b,))
        e = g.call_function(aten.add.Tensor, (c, a))
        for n in (a, e):
            n.meta["stack_trace"] = traced
        outs = [e]
        if leak:
            outs.append(g.call_function(aten.abs.default, (b,)))   # d: untraced, outside the site
        g.output(tuple(outs))
        return g, x, (a, b, c, e)

    def key(node):
        return ("f",) if node.meta.get("stack_trace") else None

    g, x, (a, b, c, e) = graph_of(leak=False)
    (site,) = provenance.find_sites(g, key)
    assert site.nodes == {a, b, c, e} and site.inputs == [x] and site.outputs == [e]
    g, x, (a, b, c, e) = graph_of(leak=True)
    (site,) = provenance.find_sites(g, key)
    assert site.nodes == {a, e} and site.inputs == [x, c] and site.outputs == [a, e]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_find_sites_absorbs_the_largest_consistent_set_of_untraced_nodes(data):
    """On random graphs of nodes traced to site A or B, untraced nodes and constants: the untraced
    nodes find_sites places are exactly the largest set that can be placed, found by trying every
    subset: a node joins the one site all its users are in (placed with it), and reads only that
    site's nodes and constants."""
    from itertools import combinations

    from dsv41c.passes import provenance
    kinds = data.draw(st.lists(st.sampled_from("AB.c"), min_size=2, max_size=11))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)
    nodes = []
    for i, kind in enumerate(kinds):
        if kind == "c" or not nodes:          # a constant: no inputs
            n = g.call_function(aten.zeros.default, ([2],))
        else:
            near = st.integers(max(0, len(nodes) - 3), len(nodes) - 1)   # (mostly recent nodes: chains)
            picks = data.draw(st.lists(st.one_of(near, near, st.integers(0, len(nodes) - 1)), min_size=1, max_size=2),
                              label=f"inputs {i}")
            args = [nodes[j] for j in picks] + ([x] if data.draw(st.booleans(), label=f"x {i}") else [])
            n = g.call_function(aten.add.Tensor, tuple(args[:2])) if len(args) > 1 else \
                g.call_function(aten.neg.default, (args[0],))
        if kind in "AB":
            n.meta["stack_trace"] = f'File "/src/dsv41c/mhc.py", line 1, in f\n    site {kind}\n'
        n.meta["site"] = kind
        nodes.append(n)
    outs = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=3), label="outputs")
    g.output(tuple(nodes[j] for j in outs))

    def key(node):
        return (node.meta["site"],) if node.meta.get("site") in ("A", "B") else None

    placed = {n: s.key[0] for s in provenance.find_sites(g, key) for n in s.nodes if n.meta.get("site") == "."}
    owned = {n: n.meta["site"] for n in nodes if n.meta["site"] in "AB"}
    untraced = [n for n in nodes if n.meta["site"] == "." and n.users]

    def placement(subset):
        """The sites of a subset placed as the rule says, or None where it breaks the rule."""
        where = dict(owned)
        for n in reversed(subset):            # graph order reversed: users first
            homes = {where.get(u) for u in n.users}
            if len(homes) != 1 or None in homes:
                return None
            where[n] = homes.pop()
        for n in subset:
            if any(where.get(a) != where[n] and not provenance.is_constant(a) for a in n.all_input_nodes):
                return None
        return {n: where[n] for n in subset}

    best = {}
    for k in range(len(untraced), 0, -1):
        found = [p for c in combinations(untraced, k) if (p := placement(list(c))) is not None]
        if found:  # (one at most: two placeable sets' union is placeable too)
            assert len(found) == 1
            best = found[0]
            break
    assert placed == best


def test_unknown_pass_is_an_error():
    with pytest.raises(PassError, match="unknown pass 'nope'"):
        build_pipeline(["nope"])


def test_a_pass_error_inside_torchs_compile_errors_is_raised_as_itself():
    """Dynamo and Inductor wrap a backend's exception; `unwrapped` raises the dsv41c error inside
    (chained to the wrapper) and leaves every other exception as it is."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    from dsv41c.errors import unwrapped

    inner = PassError("pass x: no match")
    for wrapper in (InductorError(inner, None), BackendCompilerFailed(lambda: None, InductorError(inner, None), None)):
        with pytest.raises(PassError) as info, unwrapped():
            raise wrapper
        assert info.value is inner and info.value.__cause__ is wrapper
    other = BackendCompilerFailed(lambda: None, ValueError("not ours"), None)
    with pytest.raises(BackendCompilerFailed) as info, unwrapped():
        raise other
    assert info.value is other


def test_passes_only_backend_hands_the_pipeline_the_graph_inductor_does():
    """passes_only stops after the post-grad passes; up to there it is Inductor's path (freezing
    included), so the pipeline sees the same graph and leaves the same rewrite, which then runs."""
    module, x = Siblings().eval(), torch.randn(3, 7, 64)
    with torch.no_grad():
        ref = module(x)
    seen = {}
    for backend in BACKENDS:
        torch._dynamo.reset()
        log = []
        pipe = PassPipeline([ObservedPass(FuseSiblingLinears(), log, first=True, keep_code=True)], strict=True)
        options = {**inductor_options(pipe), "fx_graph_cache": False}
        with torch.no_grad(), torch._inductor.config.patch(options):
            out = torch.compile(module, backend=dynamo_backend(backend), fullgraph=True)(x)
        for o, r in zip(out, ref):
            assert ((o - r).abs().max() / r.abs().max()).item() < 1e-6
        seen[backend] = [(s.stage, s.counts, s.code) for s in log]
    assert [(stage, counts.gemms) for stage, counts, _ in seen["passes_only"]] == [("input", 4), ("fuse_wqa_wkv", 2)]
    assert seen["passes_only"] == seen["inductor"]


# ---------------------------------------------------------------------------- the whole model
def attention_gemms(role, completes_group: bool) -> tuple[int, int]:
    """(before, after) GEMMs of one attention sublayer, from the projections of spec §6.

    On the attention input x: wq_a, wkv, the compressor's wkv (and wgate when ratio >= 2) in a kv
    source, the indexer's weights_proj in an index source. On qr = q_norm(wq_a(x)): wq_b and the
    indexer's wq_b. On their own inputs: wo_b, and the indexer's wk when a layer owning index keys
    completes a compression group in this call. wo_a is the grouped einsum (a bmm, not counted).
    fuse_wqa_wkv turns the x group and the qr group into one GEMM each (fp32: one weight dtype).
    """
    on_x = 2 + (role.ratio >= 2 and role.is_kv_source) + role.is_kv_source + role.is_index_source
    on_qr = 1 + role.is_index_source
    alone = 1 + (role.owns_index_keys and completes_group)
    return on_x + on_qr + alone, 1 + 1 + alone


def per_attention_layer(paths) -> dict[int, int]:
    counts: dict[int, int] = {}
    for path in paths:
        parts = path.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[2] == "attn":
            counts[int(parts[1])] = counts.get(int(parts[1]), 0) + 1
    return counts


@pytest.fixture(scope="module")
def compiled_golden(tmp_path_factory):
    """tiny's dimensions cut to one layer of each compressed kind (Full, Reindex, Reuse, ratio 1,
    with the candidate funnel; 2 experts, 1 Sinkhorn iteration, no Engram or DSpark: the compile of
    the prefill graph grows with all of these), a golden file recorded from it, and the check of
    dsv41c.compile (passes_only) against eager."""
    path = record_tiny_cut(tmp_path_factory.mktemp("kinds"), "kinds", 1, **THREE_KINDS, hc_sinkhorn_iters=1,
                           engram_layer_ids=[], engram_num_embeddings=[])
    torch._dynamo.reset()
    model = golden.load_golden(path).build_model()
    compiled = dsv41c.compile(model, strict=True, backend="passes_only", observe=True)
    report = golden.check(path, runner=compiled, model=model, runner_name="compiled")
    return model, compiled, report


def test_compiled_model_matches_eager_within_the_design_bound(compiled_golden):
    _, compiled, report = compiled_golden
    rows = [r for r in report.rows if r.subject == "compiled"]
    assert [(r.output, r.step) for r in rows] == [("prefill logits", None), ("decode logits", 0), ("greedy tokens", None)]
    assert all(r.ok for r in report.rows), report.failure()
    assert all(r.error <= 1e-4 for r in rows[:2]) and rows[2].error == 0 and report.first_divergence is None
    assert compiled.graphs == 2                      # the prefill and the decode step


def test_fuse_wqa_wkv_gemms_per_layer_kind(compiled_golden):
    model, compiled, report = compiled_golden
    prompt = golden.load_golden(report.path).prompt_len
    plan = model.plan
    assert [r.kind for r in plan] == ["full", "reindex", "reuse"]
    for graph, start in ((1, 0), (2, prompt)):
        snaps = {s.stage: s for s in compiled.snapshots if s.graph == graph}
        before, after = per_attention_layer(snaps["input"].gemms), per_attention_layer(snaps["fuse_wqa_wkv"].gemms)
        # a prefill completes groups of every ratio; the decode step at `start` those with (start+1) % ratio == 0
        expected = {r.layer_id: attention_gemms(r, start == 0 or (start + 1) % r.ratio == 0) for r in plan}
        assert before == {i: e[0] for i, e in expected.items()}, (graph, before)
        assert after == {i: e[1] for i, e in expected.items()}, (graph, after)
    # a group of n GEMMs becomes one: the graph loses (removed - matches) GEMMs in all
    stats = compiled.pipeline.stats["fuse_wqa_wkv"]
    lost = sum(s.counts.gemms * (1 if s.stage == "input" else -1) for s in compiled.snapshots)
    assert lost == stats.nodes_removed - stats.matches > 0
