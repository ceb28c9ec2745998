"""lower_mhc on the whole model (passes_only backend: the rewritten post-grad graph runs as is, the
mHC kernels through their TileLang C builds) and its strict-mode failures on small graphs."""
import operator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import THREE_KINDS, record_tiny_cut

import dsv41c
from dsv41c import golden, mhc
from dsv41c.passes.lower_mhc import LowerMHC, find_sites
from dsv41c.passes.manager import PassError, PassPipeline

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("mhc_pre", "mhc_post_pre", "mhc_post_collapse")


def expected_calls(n_layers: int, engram: set[int]) -> dict[str, int]:
    """Kernel calls the model's structure implies: every attention expand feeds the FFN's mixes
    and collapse (post_pre); an FFN expand feeds the next layer's unless an Engram layer comes
    first or it is the last (post_collapse: the head's collapse, or none); a layer's first site
    reads fresh streams after the embedding and after each Engram layer (pre)."""
    ffn_into_next = sum(1 for i in range(n_layers - 1) if i + 1 not in engram)
    return {"mhc_post_pre": n_layers + ffn_into_next,
            "mhc_post_collapse": n_layers - ffn_into_next,
            "mhc_pre": len(engram | {0})}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """tiny cut to 3 layers (Full, Reindex, Reuse), Engram before layers 0 and 2, 2 Sinkhorn
    iterations, no DSpark; a golden recorded from eager, replayed through the compiled model."""
    path = record_tiny_cut(tmp_path_factory.mktemp("mhc"), "mhc", 2, **THREE_KINDS, hc_sinkhorn_iters=2,
                           engram_layer_ids=[0, 2])
    torch._dynamo.reset()
    model = golden.load_golden(path).build_model()
    compiled = dsv41c.compile(model, passes=("lower_mhc", "fuse_wqa_wkv"), strict=True, backend="passes_only",
                              keep_code=True)
    report = golden.check(path, runner=compiled, model=model, runner_name="compiled")
    return model, compiled, report


def test_every_mhc_site_becomes_one_kernel_call(lowered):
    model, compiled, _ = lowered
    want = expected_calls(model.args.n_layers, set(model.args.engram_layer_ids))
    for graph in (1, 2):                                  # prefill, decode step
        snaps = {s.stage: s for s in compiled.snapshots if s.graph == graph}
        before, after = snaps["input"], snaps["lower_mhc"]
        assert before.counts.mhc > 100 and after.counts.mhc == 0       # no eager mHC op is left
        assert "sum.dim_IntList" in before.code and "div.Tensor" in before.code
        calls = {k: after.code.count(f"torch.ops.dsv41c.{k}.default(") for k in KERNELS}
        assert calls == want, (graph, calls)
        assert after.counts.gemms == before.counts.gemms - 2 * model.args.n_layers  # the mixes GEMMs
    stats = compiled.pipeline.stats["lower_mhc"]
    assert stats.matches == 2 * sum(want.values())


def test_lowered_model_matches_eager_and_golden(lowered):
    _, _, report = lowered
    assert all(r.ok for r in report.rows), report.failure()
    compiled_rows = [r for r in report.rows if r.subject == "compiled"]
    assert len(compiled_rows) == 4 and all(r.error <= 1e-4 for r in compiled_rows[:3])
    assert report.first_divergence is None


def fold_bf16_round_trips(graph: torch.fx.Graph) -> None:
    """What torch 2.11's `pointless_convert` does to the model's graph (2.13 keeps the rounding):
    `convert(convert(x fp32, bf16), fp32)`, the bf16 value read by nothing else, becomes x, so a
    collapse output stored in bf16 and read only by the next norm in fp32 turns into its fp32
    value before the rounding."""
    convert = torch.ops.prims.convert_element_type.default
    for node in list(graph.nodes):
        inner = node.args[0] if node.target is convert and node.args[1] == torch.float32 else None
        if isinstance(inner, torch.fx.Node) and inner.target is convert and inner.args[1] == torch.bfloat16 \
                and len(inner.users) == 1 and inner.args[0].meta["val"].dtype == torch.float32:
            node.replace_all_uses_with(inner.args[0])
    graph.eliminate_dead_code()


def bf16_cut_compiled():
    args = dsv41c.ModelArgs.from_json(ROOT / "configs" / "tiny.json").replace(
        **THREE_KINDS, hc_sinkhorn_iters=2, engram_layer_ids=[0, 2])
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = dsv41c.compile(model, passes=("fuse_wqa_wkv", "lower_mhc"), strict=True, backend="passes_only",
                              keep_code=True)
    return args, model, compiled


def seeded_ids(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 12), generator=g), torch.randint(0, vocab, (2, 1), generator=g)


@pytest.mark.parametrize("fold, seed", [
    pytest.param(False, 0, id="graph-as-traced"),
    pytest.param(True, 0, id="bf16-round-trips-folded"),
])
def test_bf16_streams_lower_every_site_and_stay_within_the_bf16_bound(fold, seed):
    """bf16 streams, batch 2 (a symbolic batch): the eager ops read `h.float()`, and Inductor's CSE
    leaves such upcasts shared between sites; the kernels take the stored bf16 streams. Shape
    arithmetic traced in mhc.py (batch x length) is shared by later views and belongs to no site.
    With the round trips folded (torch 2.11's Inductor), a collapse output is an fp32 value; the
    kernel's bf16 output is upcast in its place. Prefill and one decode step of the same cut as above."""
    args, model, compiled = bf16_cut_compiled()
    ids, token = seeded_ids(args.vocab_size, seed)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=fold_bf16_round_trips if fold else None):
        out = [compiled(ids, 0).float(), compiled(token, 12).float()]
    model.reset_cache()
    ref = [model(ids, 0).float(), model(token, 12).float()]
    for o, r in zip(out, ref, strict=True):
        assert o.isfinite().all() and (o - r).abs().max() <= 2e-2 * r.abs().max()
    want = expected_calls(args.n_layers, {0, 2})
    for graph in (1, 2):                                  # prefill, decode step
        code = next(s for s in compiled.snapshots if s.graph == graph and s.stage == "lower_mhc").code
        assert {k: code.count(f"torch.ops.dsv41c.{k}.default(") for k in KERNELS} == want, graph
    torch._dynamo.reset()


class TopkRecorder(TorchDispatchMode):
    """Input and indices of every aten.topk call run under it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            self.calls.append((args[0].clone(), out[1].clone()))
        return out


@pytest.mark.slow  # a compile of its own (~90 s on a CPU) to explain one input's deviation; opt in with -m slow
def test_the_seed_3_deviation_is_one_indexer_top_k_near_tie(monkeypatch):
    """On these inputs (seed 3) the lowered bf16 decode step, with torch 2.11's round trips folded, is
    ~6% from eager bf16 in one sequence of two. The cause: the indexer's bf16 scores of that
    sequence's top-8 of 13 compressed rows have a near-tie at the 8th place (eager: 2 bf16 steps
    apart); the folded graph's scores differ from eager's by more than that margin, tie there, and
    the top-k takes the other row. Asserted: every top-k selection of the decode step agrees with
    eager's but one row of one call; eager's margin between the two rows swapped is within the
    compiled-vs-eager score difference; the other sequence stays within the bf16 bound."""
    import dsv41c.compiler as compiler
    recorders, inner = [], compiler._post_grad_only

    def recording(gm, example_inputs, **kwargs):               # the GraphModule's aten ops, run under the mode
        run = inner(gm, example_inputs, **kwargs)

        def run_recorded(boxed):
            if not recorders:
                return run(boxed)
            with recorders[-1]:
                return run(boxed)
        run_recorded._boxed_call = True
        return run_recorded

    monkeypatch.setattr(compiler, "_post_grad_only", recording)
    args, model, compiled = bf16_cut_compiled()
    ids, token = seeded_ids(args.vocab_size, 3)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=fold_bf16_round_trips):
        compiled(ids, 0)
        recorders.append(TopkRecorder())
        out = compiled(token, 12).float()
    model.reset_cache()
    model(ids, 0)
    with TopkRecorder() as eager:
        ref = model(token, 12).float()
    mine = recorders[-1]
    assert len(mine.calls) == len(eager.calls) > 0
    flips = []
    for (x, got), (y, want) in zip(mine.calls, eager.calls, strict=True):
        assert got.shape == want.shape
        rows = (got.sort(-1).values != want.sort(-1).values).any(-1).nonzero().tolist()
        flips += [(x[tuple(r)], y[tuple(r)], set(got[tuple(r)].tolist()), set(want[tuple(r)].tolist()), r[0])
                  for r in rows]
    assert len(flips) == 1, f"{len(flips)} top-k rows differ from eager"
    scores, eager_scores, picked, eager_picked, seq = flips[0]
    assert (scores.numel(), len(picked)) == (13, 8)                 # the indexer: top 8 of 13 compressed rows
    (taken,), (dropped,) = picked - eager_picked, eager_picked - picked
    margin = (eager_scores[dropped].float() - eager_scores[taken].float()).abs()
    finite = eager_scores.isfinite()
    disagreement = (scores[finite].float() - eager_scores[finite].float()).abs().max()
    assert scores[taken] >= scores[dropped] and margin <= disagreement, (margin, disagreement)
    err = (out - ref).abs().amax(-1) / ref.abs().max()
    assert err[1 - seq] <= 2e-2 < err[seq], err


def test_shape_arithmetic_belongs_to_no_site():
    """A product of symbolic sizes traced at an mHC line (batch x length, for a flatten) is shared
    by every later view of that shape, so it is never a site's node (small.json, batch 2, bf16: it
    was left behind as an 'eager mHC op' once the sites were lowered)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from dsv41c.passes.lower_mhc import _site_key
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    trace = 'File "/src/dsv41c/mhc.py", line 31, in hc_mixes\n    s = h.flatten(-2).float()\n'
    size = graph.call_function(operator.mul, (a, b))
    size.meta.update(val=ShapeEnv().create_unbacked_symint() * 2, stack_trace=trace)
    tensor = graph.call_function(torch.ops.aten.mul.Tensor, (a, b))
    tensor.meta.update(val=torch.empty(2), stack_trace=trace)
    assert _site_key(tensor) is not None and _site_key(size) is None


class Args:
    hc_mult, dim = 4, 32


class Streams(torch.nn.Module):
    """One mixes site and two collapses of the same streams: the second collapse has no partner."""

    def __init__(self):
        super().__init__()
        self.args = Args()
        self.hc_attn_fn = torch.nn.Parameter(torch.randn(24, 128) * 0.1)
        self.hc_attn_scale = torch.nn.Parameter(torch.rand(3))
        self.hc_attn_base = torch.nn.Parameter(torch.randn(24))
        self.hc = dict(norm_eps=1e-20, hc_eps=1e-6, iters=3)

    def mixes(self, site, h):
        return mhc.hc_mixes(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                            getattr(self, f"hc_{site}_base"), **self.hc)

    def forward(self, h, w):
        pre, post, comb = self.mixes("attn", h)
        x = mhc.hc_collapse(h, w)
        stray = mhc.hc_collapse(h, pre)
        return x, stray, post, comb


def compile_streams(module, pipeline):
    from dsv41c.compiler import dynamo_backend, inductor_options
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch({**inductor_options(pipeline), "fx_graph_cache": False}):
        fn = torch.compile(module, backend=dynamo_backend("passes_only"), fullgraph=True)
        return fn(torch.randn(2, 4, 32), torch.rand(2, 4))


def test_a_site_left_unmatched_is_an_error():
    module = Streams().eval()
    lower = LowerMHC()
    lower.bind(module)
    with pytest.raises(Exception, match="mHC site.* left unmatched, first: hc_collapse"):
        compile_streams(module, PassPipeline([lower], strict=True))


def test_pipelines_with_lower_mhc_keep_softmax_unfused():
    """Inductor's CUDA online-softmax rewrite would split the Sinkhorn out of its mHC site."""
    from dsv41c.compiler import inductor_options
    from dsv41c.passes.fuse_wqa_wkv import FuseSiblingLinears
    assert inductor_options(PassPipeline([LowerMHC()]))["online_softmax"] is False
    assert "online_softmax" not in inductor_options(PassPipeline([FuseSiblingLinears()]))


def test_observed_pipelines_keep_softmax_unfused():
    """`observe` (the CLI's `dsv41c compile` always observes) wraps each pass to record the graph;
    the wrapper must ask Inductor for what the pass needs. It did not, and on an H200 the CLI's
    prefill then failed in lower_mhc: the online softmax had split the Sinkhorn out of its site."""
    from dsv41c.compiler import inductor_options
    model = dsv41c.build_model(dsv41c.ModelArgs.from_json(ROOT / "configs" / "tiny.json"), seed=0)
    for observe in (False, True):
        compiled = dsv41c.compile(model, ("fuse_wqa_wkv", "lower_mhc"), observe=observe)
        assert inductor_options(compiled.pipeline)["online_softmax"] is False, observe


def test_unbound_pass_is_an_error():
    with pytest.raises(Exception, match="no model bound"):
        compile_streams(Streams().eval(), PassPipeline([LowerMHC()]))


def test_sites_are_found_by_provenance():
    """find_sites groups the post-grad nodes of each eager mHC call: a mixes site reads the streams
    (and folded constants) and yields pre, post, comb; a collapse reads streams and weights."""
    seen = {}

    class Record(LowerMHC):
        def apply(self, graph):
            seen["sites"] = [(s.kind, sum(n.op != "get_attr" for n in s.inputs), len(s.outputs))
                             for s in find_sites(graph)]
            raise PassError("stop")

    module = Streams().eval()
    with pytest.raises(Exception, match="stop"):
        compile_streams(module, PassPipeline([Record()]))
    assert sorted(seen["sites"]) == [("hc_collapse", 2, 1), ("hc_collapse", 2, 1), ("hc_mixes", 1, 3)]
