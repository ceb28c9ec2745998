"""lower_indexer: the eager indexer (scores, funnel, top-k) becomes the TileLang indexer kernels.

Small graphs (fast): two real `Indexer` modules, a candidate source and an index source that uses
its candidates, over keys read from packed MXFP4 bytes as the fp4_kv pass leaves them; the lowered
graph against eager, and the sites the kernels cannot take (fp32, plain keys), which strict mode
turns into errors. The whole model (slow): the 3-layer tiny cut in bf16 with kv_quant, compiled
with fp4_kv and lower_indexer, against eager kv_quant.

Ties: the kernels give a tie to the lower index; the eager bf16 path uses torch.topk's order
(implementation-defined, spec §6.5). The eager references here run with the lower-index rule
(`eager_stable`), so that the lists can be compared exactly; the scores are bit-identical because
the queries are MXFP4-quantised (kv_quant).
"""
import json
import re

import pytest
import torch
from conftest import ROOT, THREE_KINDS
from torch import nn

import dsv41c
from dsv41c import attention, golden, quant
from dsv41c.attention import CallState, Indexer
from dsv41c.config import ModelArgs, build_layer_plan
from dsv41c.passes.lower_indexer import LowerIndexer, _key
from dsv41c.passes.manager import PassError, PassPipeline
from dsv41c.tilelang_kernels import attention as kernel_attention
from dsv41c.tilelang_kernels import indexer as kernel_indexer  # (also registers dsv41c::index_*)
from dsv41c.tilelang_kernels import quant as _codecs
from dsv41c.tilelang_kernels.quant import rows_buffer

KERNELS = ("index_scores", "candidate_blocks", "index_topk")
OVERRIDES = dict(THREE_KINDS, hc_sinkhorn_iters=1, candidate_block_size=8, candidate_topk_blocks=2,
                 engram_layer_ids=[], engram_num_embeddings=[])


def cut_args(**extra) -> ModelArgs:
    raw = json.loads((ROOT / "configs" / "tiny.json").read_text())
    raw.update(OVERRIDES, **extra)
    return ModelArgs.from_dict(raw)


def stable_top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The kernels' tie rule (lower index first) on the exact fp32 image of the scores."""
    return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]


@torch.no_grad()
def eager_stable(module, inputs):
    """The eager module, its indexers picking ties as the kernels do (exact list comparisons)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "top_indices", stable_top_indices)
        return module(*inputs)


def kernel_calls(code: str) -> dict[str, int]:
    return {k: code.count(f"torch.ops.dsv41c.{k}.default(") for k in KERNELS}


def indexer_tensor_nodes(graph) -> int:
    """Tensor nodes traced from the indexer's site lines (symbolic sizes may stay: k = min(...))."""
    return sum(1 for n in graph.nodes if n.op == "call_function" and _key(n) is not None
               and isinstance(n.meta.get("val"), torch.Tensor))


# ------------------------------------------------------------------------------ small graphs
class TwoIndexers(nn.Module):
    """Layers 0 (candidate source, Full) and 1 (Reindex, uses the candidates) of the cut; the keys
    are read from packed MXFP4 bytes (`packed=True`, as after fp4_kv) or given as plain rows."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, packed: bool = True, seed: int = 0):
        super().__init__()
        plan = build_layer_plan(args)
        assert plan[0].is_candidate_source and plan[1].uses_candidates
        self.source, self.user = Indexer(args, plan[0], dtype, True), Indexer(args, plan[1], dtype, True)
        self.packed, self.window = packed, args.window_size
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 if p.dim() > 1 else
                        torch.ones(p.shape))

    def forward(self, x, qr, codes, scales, rope, start_pos: int):
        state = CallState(start_pos, x.shape[1], x.shape[0], {}, None)
        keys = _codecs.mxfp4_dequant(codes, scales, x.dtype) if self.packed else codes
        return self.source(x, qr, state, keys, rope, self.window), self.user(x, qr, state, keys, rope, self.window)


def small_inputs(args: ModelArgs, dtype, s: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, s, args.dim, generator=g).to(dtype)
    qr = torch.randn(2, s, args.q_lora_rank, generator=g).to(dtype)
    keys = quant.fp4_ue8m0_fake_quant(torch.randn(2, n, args.index_head_dim, generator=g).to(dtype), 32)
    codes, scales = quant.mxfp4_quant_ref(keys)
    angle = torch.rand(s, args.rope_head_dim // 2, generator=g) * 6.3
    rope = torch.stack([angle.cos(), angle.sin()], dim=-1)
    return x, qr, codes, scales, keys, rope


class Record(LowerIndexer):
    """LowerIndexer that keeps the graph code before and after."""

    def __init__(self, log: list, **options):
        super().__init__(**options)
        self.log = log

    def apply(self, graph):
        before = graph.owning_module.print_readable(print_output=False)
        nodes = indexer_tensor_nodes(graph)
        stats = super().apply(graph)
        self.log.append((before, nodes, graph.owning_module.print_readable(print_output=False),
                         indexer_tensor_nodes(graph)))
        return stats


def compile_small(module, lower, s: int, n: int, start_pos: int, dtype=torch.bfloat16, plain_keys=False):
    from dsv41c.compiler import dynamo_backend, inductor_options
    torch._dynamo.reset()
    lower.bind(module)
    pipeline = PassPipeline([lower], strict=lower.strict)
    x, qr, codes, scales, keys, rope = small_inputs(module.args, dtype, s, n)
    inputs = (x, qr, keys if plain_keys else codes, scales, rope, start_pos)
    with torch.no_grad(), torch._inductor.config.patch({**inductor_options(pipeline), "fx_graph_cache": False}):
        fn = torch.compile(module, backend=dynamo_backend("passes_only"), fullgraph=True)
        return fn(*inputs), inputs, pipeline


def small_module(dtype=torch.bfloat16, packed=True, **extra):
    args = cut_args(**extra)
    module = TwoIndexers(args, dtype, packed).eval()
    module.args = args
    return module


# (S queries, n keys, start_pos): a prefill of 21 tokens (3 candidate blocks, 2 kept, the newest
# pinned), decode steps at positions 22 and 23 (23 keys; 24 keys, whole blocks: the graph has no
# cut of the repeated block flags to n entries)
CASES = {"prefill": (21, 21, 0), "decode": (1, 23, 22), "decode_whole_blocks": (1, 24, 23)}


@pytest.mark.parametrize("case", CASES)
def test_small_graph_is_lowered_and_matches_eager(case):
    s, n, start_pos = CASES[case]
    module, log = small_module(), []
    lower = Record(log)
    lower.strict = True
    (a, b), inputs, pipeline = compile_small(module, lower, s, n, start_pos)
    before, nodes_before, after, nodes_after = log[0]
    assert nodes_before > 40 and nodes_after == 0                      # no eager indexer tensor op left
    assert "aten.topk" in before and "aten.bmm" in before
    assert "aten.topk" not in after and "aten.bmm" not in after and "aten.sort" not in after
    assert "mxfp4_dequant" not in after                                # the kernels read the bytes
    assert kernel_calls(before) == dict.fromkeys(KERNELS, 0)
    assert kernel_calls(after) == {"index_scores": 2, "candidate_blocks": 1, "index_topk": 2}
    # the user layer's top-k gets the source's block flags (it reads only the kept blocks' scores)
    topk_args = re.findall(r"torch\.ops\.dsv41c\.index_topk\.default\(\w+, \w+, (\w+),", after)
    assert topk_args == ["None", re.search(r"(\w+)\s*:[^=]*= torch\.ops\.dsv41c\.candidate_blocks", after)[1]]
    stats = pipeline.stats["lower_indexer"]
    assert stats.details == ["index_scores + candidate_blocks + index_topk at source",
                             "index_scores + index_topk at user (candidates)"]
    assert stats.matches == 2 and stats.nodes_removed > 40
    ra, rb = eager_stable(module, inputs)
    assert torch.equal(a, ra) and torch.equal(b, rb)
    k = min(module.args.index_topk, n)
    assert a.shape == (2, s, k) and a.dtype == torch.int32
    if case != "prefill":                   # the funnel dropped a block: the user layer differs
        assert (rb >= 0).all() and not torch.equal(ra, rb)
    else:                                   # prefill: the first queries see few entries (-1)
        assert (ra[:, 0] == -1).sum() == 2 * (k - 1)


@pytest.mark.parametrize("case", CASES)
def test_tinys_block_size_is_lowered_on_the_cpu(case):
    """tiny's own candidate blocks of 4 entries (6 blocks for 21 keys): every site lowered in strict
    mode, the ops given `block=4` (the C builds take any size), the lists equal eager's."""
    s, n, start_pos = CASES[case]
    module, log = small_module(candidate_block_size=4), []
    assert module.source.block_size == 4
    lower = Record(log)
    lower.strict = True
    (a, b), inputs, pipeline = compile_small(module, lower, s, n, start_pos)
    after = log[0][2]
    assert log[0][3] == 0 and kernel_calls(after) == {"index_scores": 2, "candidate_blocks": 1, "index_topk": 2}
    assert after.count("block = 4") == 4  # both scorings, the funnel and the user's top-k (given flags)
    assert pipeline.stats["lower_indexer"].matches == 2
    ra, rb = eager_stable(module, inputs)
    assert torch.equal(a, ra) and torch.equal(b, rb)


@pytest.mark.parametrize("case", ("prefill", "decode"))
def test_source_topk_gets_its_funnel_flags_when_they_keep_it(case):
    """With more candidate blocks than top-k entries (bench.json: 2048 for 512) the candidate
    source's own top-k is given its funnel's flags (`funnel_keeps_topk`; the CUDA top-k then
    reads only the kept blocks); the lists equal eager's all the same."""
    s, n, start_pos = CASES[case]
    module, log = small_module(candidate_topk_blocks=9), []
    k = module.source.topk
    assert module.source.topk_blocks > k
    lower = Record(log)
    lower.strict = True
    (a, b), inputs, _ = compile_small(module, lower, s, n, start_pos)
    after = log[0][2]
    flags = re.search(r"(\w+)\s*:[^=]*= torch\.ops\.dsv41c\.candidate_blocks", after)[1]
    topk_args = re.findall(r"torch\.ops\.dsv41c\.index_topk\.default\(\w+, \w+, (\w+),", after)
    assert topk_args == [flags, flags]
    ra, rb = eager_stable(module, inputs)
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_small_graph_with_torch_topk_ties_selects_equal_scores():
    """Against eager's own torch.topk ties: the selected score multisets agree."""
    s, n, start_pos = CASES["prefill"]
    module = small_module()
    lower = LowerIndexer()
    lower.strict = True
    (a, _), inputs, _ = compile_small(module, lower, s, n, start_pos)
    with torch.no_grad():
        ra, _ = module(*inputs)
        x, qr, codes, scales, rope, _ = inputs
        ind = module.source
        q = quant.fp4_ue8m0_fake_quant(attention.apply_rope(ind.wq_b(qr).unflatten(-1, (ind.n_heads, ind.head_dim)),
                                                            rope), 32)
        w = ind.weights_proj(x) * ind.weight_scale
        scores = attention.index_scores(q, quant.mxfp4_dequant_ref(codes, scales, torch.bfloat16), w)
    window = module.window

    def picked(idx):
        valid = idx >= 0
        got = scores.gather(-1, (idx - window).clamp(min=0).long())
        return torch.where(valid, got.float(), float("nan")).sort(dim=-1).values
    torch.testing.assert_close(picked(a), picked(ra), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(a < 0, ra < 0)


@pytest.mark.parametrize("what", ["fp32", "plain_keys"])
def test_a_site_the_kernels_cannot_take_fails_in_strict_mode(what):
    dtype = torch.float32 if what == "fp32" else torch.bfloat16
    module = small_module(dtype, packed=what != "plain_keys")
    lower = LowerIndexer()
    lower.strict = True
    message = "bf16 only" if what == "fp32" else "not a packed MXFP4 cache read"
    with pytest.raises(Exception, match=rf"lower_indexer: 2 indexer site\(s\) left as torch ops, first: .*{message}") \
            as info:
        compile_small(module, lower, 9, 9, 0, dtype, plain_keys=what == "plain_keys")
    assert isinstance(info.value, PassError) or "PassError" in str(info.value)


def test_a_site_left_as_torch_ops_is_reported_and_correct_otherwise():
    module = small_module(torch.float32)
    lower = LowerIndexer()
    with pytest.warns(UserWarning, match="2 indexer site"):
        (a, b), inputs, pipeline = compile_small(module, lower, 9, 9, 0, torch.float32)
    stats = pipeline.stats["lower_indexer"]
    assert stats.matches == 0 and len(stats.details) == 2 and all(d.startswith("left: ") for d in stats.details)
    ra, rb = eager_stable(module, inputs)
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_unbound_pass_is_an_error():
    lower = LowerIndexer()
    with pytest.raises(Exception, match="no model bound"):
        from dsv41c.compiler import dynamo_backend, inductor_options
        torch._dynamo.reset()
        module = small_module()
        x, qr, codes, scales, _, rope = small_inputs(module.args, torch.bfloat16, 9, 9)
        pipeline = PassPipeline([lower])
        with torch.no_grad(), torch._inductor.config.patch({**inductor_options(pipeline), "fx_graph_cache": False}):
            torch.compile(module, backend=dynamo_backend("passes_only"), fullgraph=True)(x, qr, codes, scales, rope, 0)


# ------------------------------------------------------------------------------ whole model
STEPS = 4      # decode positions 21..24 (22..25 keys)


def compile_lowered(model):
    """dsv41c.compile with fp4_kv then lower_indexer (strict, passes_only backend, graphs kept)."""
    return dsv41c.compile(model, passes=("fp4_kv", "lower_indexer"), strict=True, backend="passes_only",
                          keep_code=True)


@pytest.fixture(scope="module")
def lowered():
    """The 3-layer cut (Full: the candidate source; Reindex: uses the candidates; Reuse), bf16 with
    kv_quant, candidate blocks of 8 (2 kept); prompts of 21 tokens, greedy decode for STEPS steps,
    through the compiled model and an eager twin whose ties follow the kernels' rule."""
    args = cut_args()
    torch._dynamo.reset()
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    eager = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    compiled = compile_lowered(model)
    inputs = golden.make_inputs(args, 2, 21, seed=3)
    trace, tokens = golden.run_greedy(compiled, inputs, STEPS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "top_indices", stable_top_indices)
        eager_trace, eager_tokens = golden.run_greedy(eager, inputs, STEPS)
    return dict(model=model, compiled=compiled, trace=trace, tokens=tokens, eager_trace=eager_trace,
                eager_tokens=eager_tokens)


@pytest.mark.slow
def test_whole_model_indexers_are_kernel_calls(lowered):
    compiled = lowered["compiled"]
    # prefill, and one decode graph for every position, whole candidate blocks (n % 8 == 0) included
    # (tests/test_graph_capture.py)
    assert compiled.graphs == 2
    for graph in range(1, compiled.graphs + 1):
        snaps = {s.stage: s for s in compiled.snapshots if s.graph == graph}
        before, after = snaps["fp4_kv"].code, snaps["lower_indexer"].code
        assert kernel_calls(before) == dict.fromkeys(KERNELS, 0)
        assert kernel_calls(after) == {"index_scores": 2, "candidate_blocks": 1, "index_topk": 2}, graph
        assert "mxfp4_dequant" in before and "mxfp4_dequant" not in after
        assert snaps["lower_indexer"].counts.batched_gemms == snaps["fp4_kv"].counts.batched_gemms - 2
    stats = compiled.pipeline.stats["lower_indexer"]
    assert stats.matches == 2 * compiled.graphs
    assert stats.details[:2] == ["index_scores + candidate_blocks + index_topk at layers.0.attn.indexer",
                                 "index_scores + index_topk at layers.1.attn.indexer (candidates)"]


@pytest.mark.slow
def test_whole_model_matches_eager_kv_quant(lowered):
    """Scores are bit-identical and ties follow the same rule, so the logits are too."""
    trace, ref = lowered["trace"], lowered["eager_trace"]
    assert torch.equal(lowered["tokens"], lowered["eager_tokens"])
    errors = [golden.relative_error(trace.prefill_logits, ref.prefill_logits)]
    errors += [golden.relative_error(trace.decode_logits[:, i], ref.decode_logits[:, i]) for i in range(STEPS)]
    print(f"\nlower_indexer compiled vs eager kv_quant (bf16): relative max-abs logit error {max(errors):.2e}")
    assert max(errors) <= 1e-3, errors


@pytest.mark.slow
def test_whole_model_with_lower_sparse_attn():
    """fp4_kv, lower_indexer and lower_sparse_attn together: the attention kernel reads the lists
    index_topk publishes; greedy tokens and logits equal eager kv_quant (lower-index ties). The
    kernels get the caches uncopied (batch 2: each cache read is a strided view of its buffer)."""
    args = cut_args()
    torch._dynamo.reset()
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    eager = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    compiled = dsv41c.compile(model, passes=("fp4_kv", "lower_indexer", "lower_sparse_attn"), strict=True,
                              backend="passes_only", observe=True)
    inputs = golden.make_inputs(args, 2, 21, seed=3)
    reads = []  # (strided, copied) of every cache read the kernels get: none is copied

    def recording(t):
        out = rows_buffer(t)
        reads.append((not t.is_contiguous(), out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()))
        return out
    with pytest.MonkeyPatch.context() as mp:
        for module in (kernel_attention, kernel_indexer):
            mp.setattr(module, "rows_buffer", recording)
        trace, tokens = golden.run_greedy(compiled, inputs, STEPS)
    assert sum(strided for strided, _ in reads) >= STEPS, reads     # batch 2: the reads are strided views
    assert not any(copied for _, copied in reads), reads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "top_indices", stable_top_indices)
        eager_trace, eager_tokens = golden.run_greedy(eager, inputs, STEPS)
    assert torch.equal(tokens, eager_tokens)
    assert golden.relative_error(trace.prefill_logits, eager_trace.prefill_logits) <= 1e-3
    assert golden.relative_error(trace.decode_logits, eager_trace.decode_logits) <= 1e-3
    stats = compiled.pipeline.stats
    assert stats["lower_indexer"].matches == 2 * compiled.graphs
    assert stats["lower_sparse_attn"].matches == args.n_layers * compiled.graphs


@pytest.mark.slow
def test_whole_model_before_the_context_fills_the_topk():
    """Prompts shorter than K_I: every compressed count n_c is below k, so the lowered top-k lists
    are padded with -1 (the eager model's -inf padding); tokens and logits equal eager."""
    args = cut_args()
    torch._dynamo.reset()
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    eager = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    inputs = golden.make_inputs(args, 2, 5, seed=4)
    assert inputs.shape[1] + 2 < args.index_topk
    trace, tokens = golden.run_greedy(compile_lowered(model), inputs, 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "top_indices", stable_top_indices)
        eager_trace, eager_tokens = golden.run_greedy(eager, inputs, 2)
    assert torch.equal(tokens, eager_tokens)
    assert golden.relative_error(trace.prefill_logits, eager_trace.prefill_logits) <= 1e-3
    assert golden.relative_error(trace.decode_logits, eager_trace.decode_logits) <= 1e-3
