"""CUDA runs of the eager model (marked gpu; skipped without a CUDA device)."""
from pathlib import Path

import pytest
import torch
from conftest import EVERY_PASS, first_four_args

import dsv41c
from dsv41c.generate import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_tiny_cuda_matches_cpu_fp32():
    args = dsv41c.ModelArgs.from_json(CONFIGS / "tiny.json")
    ids = torch.randint(0, 259, (2, 12))
    cpu = dsv41c.build_model(args, seed=0, dtype=torch.float32)
    gpu = dsv41c.build_model(args, seed=0, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        a = gpu(ids.cuda(), 0, full_logits=True).cpu()
        b = cpu(ids, 0, full_logits=True)
        assert rel_err(a, b) < 1e-4
        step_a = gpu(ids[:, :1].cuda(), 12).cpu()
        step_b = cpu(ids[:, :1], 12)
        assert rel_err(step_a, step_b) < 1e-4


def test_tiny_cuda_bf16_with_kv_quant_runs_and_drafts():
    args = dsv41c.ModelArgs.from_json(CONFIGS / "tiny.json")
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True, device="cuda")
    ids = torch.randint(0, 259, (2, 40), device="cuda")
    with torch.no_grad():
        logits, hidden = model(ids, 0, return_hidden=True)
        model.draft(logits.argmax(-1), hidden, 0)
        token = logits.argmax(-1)
        logits, hidden = model(token.view(2, 1), 40, return_hidden=True)
        out, dl, conf = model.draft(logits.argmax(-1), hidden, 40)
    assert torch.isfinite(logits).all() and torch.isfinite(dl).all() and out.shape[1] == args.dspark_block_size + 1


def test_small_generates_on_cuda():
    args = dsv41c.ModelArgs.from_json(CONFIGS / "small.json")
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True, device="cuda")
    result = generate(model, model.tokenizer.encode("The quick brown fox " * 20), 16)
    assert len(result.new_ids) == 16
    print(f"small on CUDA bf16: prefill {result.prefill_tok_s:.0f} tok/s, decode {result.decode_tok_s:.1f} tok/s")


def test_bf16_moe_grouped_gemm_on_cuda_matches_per_expert_loop():
    """The bf16 MoE's grouped GEMM path on CUDA (CUTLASS grouped kernel) against the per-expert
    loop of §7 with cuBLAS GEMMs; both round each GEMM to bf16 once, so they differ by GEMM
    rounding only. The configs/small.json expert shapes, 300 tokens."""
    from test_moe import per_expert_loop

    from dsv41c.moe import MoE
    args = dsv41c.ModelArgs.from_json(CONFIGS / "small.json")
    torch.manual_seed(0)
    moe = MoE(args, args.n_routed_experts, args.n_activated_experts, torch.bfloat16).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * p.shape[-1] ** -0.5)
        x = torch.randn(300, args.dim, device="cuda").bfloat16()
        loop = per_expert_loop(moe, x)
        got = moe(x.view(1, 300, -1))[0]
    assert moe.experts.groupable(x)
    assert rel_err(got.float(), loop) < 1e-2


def test_host_token_ids_run_on_a_cuda_model_eager_and_compiled():
    """Token ids from a tokenizer live on the host: the model (and the compiled model, before its
    graph) moves them to its device; tiny's Engram hash is the first to index with them."""
    args = dsv41c.ModelArgs.from_json(CONFIGS / "tiny.json")
    ids = torch.randint(0, 259, (1, 12), generator=torch.Generator().manual_seed(0))
    model = dsv41c.build_model(args, seed=0, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        want = model(ids.cuda(), 0).cpu()
        model.reset_cache()
        assert torch.equal(model(ids, 0).cpu(), want)
        model.reset_cache()
        compiled = dsv41c.compile(model, backend="passes_only")
        assert rel_err(compiled(ids, 0).cpu(), want) < 1e-5


def test_cpp_wrapper_on_cuda_matches_the_python_wrapper():
    """`dsv41c.compile(cpp_wrapper=True)` on CUDA: tiny's first four layers in bf16 (grouped expert
    GEMMs, through `dsv41c::grouped_mm` where torch's CUDA shims lack `_grouped_mm`) compile and
    run a prefill and 4 decode steps, fed the same tokens as the Python wrapper's compile of the
    same model. The C++ wrapper turns Triton's persistent reductions off (`CPP_WRAPPER_WORKAROUNDS`),
    so the last bits may differ, and in bf16 a routing near-tie can then flip one step (seen on the
    CPU between compiled and eager: BENCHMARKS.md); all steps but at most one must agree to 1e-2.
    About 5 minutes: two whole-model compiles."""
    torch._dynamo.reset()
    args = first_four_args()
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
    tokens = torch.randint(0, args.vocab_size, (4, 1, 1), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    for cpp in (False, True):
        compiled = dsv41c.compile(model, cpp_wrapper=cpp)
        model.reset_cache()
        with torch.no_grad():
            runs[cpp] = [compiled(ids, 0).float()] + [compiled(t, 24 + i).float() for i, t in enumerate(tokens)]
        torch._dynamo.reset()
    assert all(x.isfinite().all() for x in runs[True])
    errs = [rel_err(a, b) for a, b in zip(runs[True], runs[False], strict=True)]
    assert sorted(errs)[-2] <= 1e-2, errs


def test_cudagraphs_decode_matches_the_plain_compile_and_replays_graphs():
    """`dsv41c.compile(cudagraphs=True)`: every pass on tiny's first four layers at bench.json's
    widths (bf16, kv_quant), eager prefill, then 8 decode steps replaying the CUDA graphs of the
    position-independent partitions, against the same steps without graphs and with the graphs
    launched (torch.profiler sees cudaGraphLaunch). The graphed decode is the decode graph of the
    compile without graphs, partitioned, with exact copies of RoPE's rows, so every step must agree
    to the bf16 bound. Batch 2, where the batch is a symbol the partition rule must see past (Dynamo
    specialises batch 1). Measured bit-identical at batch 1 (this test, 8 steps) and batch 32
    (`benchmarks/cudagraphs.py`, 24 steps), both before concatenations were graphed and RoPE's rows
    copied; in this form (batch 2) it passed on an H200 in 264 s with cold caches: two compiles."""
    from torch.profiler import ProfilerActivity, profile
    torch._dynamo.reset()
    args = first_four_args("bench")
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab_size, (2, 40), generator=gen).cuda()
    tokens = torch.randint(0, args.vocab_size, (8, 2, 1), generator=gen).cuda()
    runs, launches = {}, {}
    for graphs in (True, False):
        compiled = dsv41c.compile(model, EVERY_PASS, cudagraphs=graphs)
        model.reset_cache()
        with torch.no_grad():
            model(prompt, 0)
            runs[graphs] = [compiled(t, 40 + i).float() for i, t in enumerate(tokens[:6])]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runs[graphs] += [compiled(t, 46 + i).float() for i, t in enumerate(tokens[6:])]
                torch.cuda.synchronize()
        launches[graphs] = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
        torch._dynamo.reset()
    assert launches[True] >= 2 * 8 and launches[False] == 0, launches
    assert all(x.isfinite().all() for x in runs[True])
    errs = [rel_err(a, b) for a, b in zip(runs[True], runs[False], strict=True)]
    print("cudagraphs vs plain per step:", errs)
    assert max(errs) <= 2e-2, errs
