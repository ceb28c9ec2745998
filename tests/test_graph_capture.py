"""The eager model is written to be captured whole by Dynamo: no graph breaks in prefill or decode,
and one decode graph for every position (issue 4's precondition).

Traced with a counting backend (Dynamo only, no Inductor), so the outputs are the eager ones.
"""
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import dsv41c

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


@pytest.fixture(scope="module")
def traced():
    torch._dynamo.reset()
    model = dsv41c.build_model(dsv41c.ModelArgs.from_json(TINY), seed=0)
    counter = CompileCounter()
    fn = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=True)
    return model, fn, counter


def test_prefill_and_decode_capture_without_breaks_one_graph_each(traced):
    model, fn, counter = traced
    ids = torch.randint(0, 259, (2, 40))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):   # MoE routing in prefill
        out = fn(ids, 0, True)                      # fullgraph=True: a graph break would raise
        assert counter.frame_count == 1
        ref = model(ids, 0, full_logits=True)
        assert torch.equal(out, ref)
        token = out[:, -1].argmax(-1, keepdim=True)
        frames = []
        for p in range(40, 60):                     # 20 decode steps
            logits = fn(token, p)
            frames.append(counter.frame_count)
            token = logits.argmax(-1, keepdim=True)
    # one graph for the prefill, one for every decode position (no branch or contiguity guard on it)
    assert frames == [2] * len(frames), frames


def test_prefill_is_one_graph_for_prompts_of_either_parity():
    """tiny's ratio-2 compressors write the open group of a prompt without a branch on the length's
    remainder, so one prefill graph serves even and odd prompt lengths (an export: one package)."""
    model = dsv41c.build_model(dsv41c.ModelArgs.from_json(TINY), seed=0)
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for n in (40, 41, 42, 45):
            ids = torch.randint(0, 259, (1, n))
            model.reset_cache()
            got = fn(ids, 0)
            model.reset_cache()
            assert torch.equal(got, model(ids, 0)), n
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_decode_is_one_graph_while_the_top_k_lists_are_longer_than_the_cache():
    """index_topk and candidate_topk_blocks beyond the entries a decode step sees (as bench.json at
    a short context): the lists keep their width (-1 padding), so no position adds a graph. bf16:
    its sparse attention loops over blocks of the list, as the official kernel does."""
    args = dsv41c.ModelArgs.from_json(TINY).replace(index_topk=64, candidate_topk_blocks=24)
    eager, traced = (dsv41c.build_model(args, seed=0, dtype=torch.bfloat16) for _ in range(2))
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(traced.forward, backend=counter, fullgraph=True, dynamic=True)
    ids = torch.randint(0, 259, (1, 40))
    token = eager(ids, 0).argmax(-1, keepdim=True)
    traced(ids, 0)                                  # the same caches, filled eagerly
    for p in range(40, 52):                         # at most 52 entries per layer: fewer than 64
        ref, out = eager(token, p), fn(token, p)
        assert torch.equal(out, ref), p
        token = ref.argmax(-1, keepdim=True)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_decode_far_beyond_the_compiled_positions_reuses_the_graph():
    """benchmarks/compile.py --long-context times decode steps at a position reached by
    ModelCache.fill_synthetic instead of a prefill: the decode graph traced near the start serves
    them, and computes what eager does on the same caches."""
    args = dsv41c.ModelArgs.from_json(TINY)
    eager, traced = (dsv41c.build_model(args, seed=0) for _ in range(2))
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(traced.forward, backend=counter, fullgraph=True, dynamic=True)
    ids = torch.randint(0, 259, (1, 40))
    eager(ids, 0), traced(ids, 0)
    token = torch.tensor([[7]])
    for p in range(40, 60):
        fn(token, p)
    graphs = counter.frame_count
    far = args.max_seq_len - 8
    for model in (eager, traced):
        model.cache.fill_synthetic(seed=3, vocab_size=args.vocab_size)
    for p in range(far, far + 4):
        ref, out = eager(token, p), fn(token, p)
        assert torch.equal(out, ref) and out.isfinite().all(), p
    assert counter.frame_count == graphs
    torch._dynamo.reset()


def test_batched_bf16_decode_is_one_graph_from_the_first_positions_to_far_ones():
    """Batch 2, bf16 (the deployment setting): from a 5-token prompt (fewer compressed rows than
    index_topk, entry counts both multiples of the candidate block and not) to positions far past
    both, one decode graph. (The candidate entry mask was once a cut [..., :n] of the repeated block
    flags, non-contiguous unless n % block == 0: batched decode guarded on that and compiled a
    second graph.)"""
    args = dsv41c.ModelArgs.from_json(TINY).replace(max_seq_len=1024, max_batch_size=2)
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=True)
    model(torch.randint(0, 259, (2, 5)), 0)
    token = torch.full((2, 1), 7)
    for p in range(5, 9):
        fn(token, p)
    model.cache.fill_synthetic(seed=3, vocab_size=args.vocab_size)
    for p in (1000, 1001):
        fn(token, p)
    assert counter.frame_count == 1
    torch._dynamo.reset()
