"""The pass framework and fuse_wqa_wkv on small graphs (fast: one Inductor compile each)."""
import pytest
import torch
from torch import nn

from dsv41c.compiler import inductor_options
from dsv41c.passes.fuse_wqa_wkv import FuseSiblingLinears
from dsv41c.passes.manager import GraphPass, PassError, PassPipeline, PassStats, build_pipeline

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


def test_unknown_pass_is_an_error():
    with pytest.raises(PassError, match="unknown pass 'nope'"):
        build_pipeline(["nope"])
