"""Sparse attention kernels (tilelang_kernels/attention.py) against the torch references.

CPU tests run the C-target builds (one build per variant and process); `gpu` tests run the CUDA
builds on an H200-class device and compare with the references computed on the same device, both
with each query's list split over several CTAs (decode, small batches) and walked by one CTA
(prefill, large batches).  Inputs are fresh random every run (the seed is in each failure
message): random lists with -1 entries, entries past the rows, duplicates, an all -1 query, list
widths that are not a multiple of 64 or of the split, and packed rows made by the quantisers.

Bounds.  Kernel and reference compute the same formula; they differ in the summation order of the
fp32 dot products and sums and in expf vs torch's exp (a few fp32 ulps).  fp32: the sums over K
entries and d products then agree to (K + d |l|max) * 2^-24 relative to the values' scale (x4).
bf16: such a difference can move the bf16 rounding of one probability by one ulp (2^-8 of p, so
at most 2^-8 max|v| over the whole sum) and the bf16 rounding of o by one ulp (2^-8 |o|).  A split
list rounds p against its split's running max: a different rounding of the same size (the kernel
module's docstring; in an emulation at the released shapes it moved o by at most one bf16 ulp,
a third of this bound).
"""

import secrets

import pytest
import torch
from conftest import CopyRecorder, cache_read
from torch import nn

from dsv41c import quant as Q
from dsv41c.attention import sparse_attn as eager_sparse_attn
from dsv41c.passes.lower_sparse_attn import LowerSparseAttn
from dsv41c.passes.manager import PassError, PassPipeline
from dsv41c.tilelang_kernels import attention as A
from dsv41c.tilelang_kernels import quant as tq

DTYPES = (torch.float32, torch.bfloat16)
D_CPU = 128  # one head dim (and scale) for every CPU test: each kernel variant builds once
SCALE = D_CPU**-0.5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fresh_seed() -> int:
    return secrets.randbits(31)


def make_idx(b, s, k, n_rows, g, device="cpu"):
    """Random lists over n_rows with about 1/5 masked entries, and query (0, 0) all -1."""
    idx = torch.randint(0, n_rows, (b, s, k), generator=g)
    idx = torch.where(torch.rand(b, s, k, generator=g) < 0.2, -1, idx).int()
    idx[0, 0] = -1
    return idx.to(device)


def bound(ref: torch.Tensor, values: torch.Tensor, q, k: int, scale: float) -> torch.Tensor:
    """Allowed |kernel - ref| per element (module docstring)."""
    vmax = values.float().abs().max()
    if ref.dtype == torch.float32:
        lmax = q.float().abs().max() * vmax * q.shape[-1] * scale
        return torch.full_like(ref, float(4 * (k + q.shape[-1] * lmax) * 2.0**-24 * vmax))
    return 2.0**-8 * (ref.float().abs() + vmax)


def check(out, ref, values, q, k, scale, seed, empty_first=True):
    assert out.dtype == ref.dtype and out.shape == ref.shape, seed
    assert not out.isnan().any(), f"NaN in the kernel output, seed {seed}"
    err = (out.float() - ref.float()).abs()
    tol = bound(ref, values, q, k, scale)
    assert (err <= tol).all(), (f"seed {seed}: max err {err.max().item():.3g}, "
                                f"{int((err > tol).sum())} elements over the bound")
    if empty_first:
        assert (out[0, 0] == 0).all(), f"seed {seed}: a query with no valid entry must return 0"


def packed_inputs(b, s, h, d, n_w, n_c, k, dtype, fp8, g, device="cpu"):
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    window = torch.randn(b, n_w, d, generator=g) * 2
    scales = None
    if fp8:
        window, scales = Q.fp8_quant_ref(window)
    else:
        window = window.to(dtype)
    codes, cscales = Q.fp4_e4m3_quant_ref(torch.randn(b, n_c, d, generator=g))
    sink = torch.randn(h, generator=g)
    idx = make_idx(b, s, k, n_w + n_c, g)
    return tuple(None if t is None else t.to(device) for t in (q, window, scales, codes, cscales, sink, idx))


def decoded_rows(window, scales, codes, cscales, dtype):
    rows = window if scales is None else Q.fp8_dequant_ref(window, scales, dtype)
    return torch.cat([rows.to(dtype), Q.fp4_e4m3_dequant_ref(codes, cscales, dtype)], dim=1)


# ------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attn_cpu(dtype):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h, d, n, k = 2, 3, 4, D_CPU, 150, 140
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    kv = (torch.randn(b, n, d, generator=g) * 2).to(dtype)
    sink = torch.randn(h, generator=g)
    idx = make_idx(b, s, k, n, g)
    scale = d**-0.5
    out = A.sparse_attn(q, kv, sink, idx, scale)
    check(out, A.sparse_attn_ref(q, kv, sink, idx, scale), kv, q, k, scale, seed)


# (fp32 and bf16 share the attention body; the window loaders differ): the three builds used
# by the CI models (fp32: prefill and decode) and by deployment decode (bf16, FP8 ring)
PACKED_CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]


@pytest.mark.parametrize("dtype,fp8", PACKED_CASES, ids=["fp32-rows", "fp32-fp8", "bf16-fp8"])
def test_sparse_attn_packed_cpu(dtype, fp8):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h, d, n_w, n_c, k = 2, 3, 4, D_CPU, 20, 100, 130
    args = packed_inputs(b, s, h, d, n_w, n_c, k, dtype, fp8, g)
    scale = d**-0.5
    out = A.sparse_attn_packed(*args, scale)
    ref = A.sparse_attn_packed_ref(*args, scale)
    check(out, ref, decoded_rows(*args[1:5], dtype), args[0], k, scale, seed)
    # no compressed rows yet: the list addresses the window only
    q, window, scales, codes, cscales, sink, idx = args
    idx_w = torch.where(idx < n_w, idx, -1)
    out = A.sparse_attn_packed(q, window, scales, codes[:, :0], cscales[:, :0], sink, idx_w, scale)
    ref = A.sparse_attn_packed_ref(q, window, scales, codes[:, :0], cscales[:, :0], sink, idx_w, scale)
    check(out, ref, decoded_rows(window, scales, codes[:, :0], cscales[:, :0], dtype), q, k, scale, seed)


@pytest.mark.parametrize("dtype,fp8", [PACKED_CASES[0], PACKED_CASES[2]], ids=["fp32-rows", "bf16-fp8"])
def test_cache_reads_go_in_uncopied_and_rows_past_the_read_stay_masked(dtype, fp8):
    """The compressed rows as the model passes them, `buf[:B, :n]` of a larger cache buffer: the op
    hands the kernel the buffer's rows without copying them (a copy costs the whole cache per call),
    and list entries naming rows n.. (inside the buffer, outside the read) are still ignored."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h, d, n_w, n_c, k = 2, 3, 4, D_CPU, 20, 100, 130
    q, window, scales, codes, cscales, sink, idx = packed_inputs(b, s, h, d, n_w, n_c, k, dtype, fp8, g)
    codes_v, cscales_v = cache_read(codes, 140, 3), cache_read(cscales, 140, 3)
    assert not codes_v.is_contiguous()
    idx, idx_ref = past_the_rows(idx, n_w + n_c, g)  # entries n_w + n_c + 7: a row of the buffer
    with CopyRecorder() as rec:
        out = A._sparse_attn_packed(q, window, scales, codes_v, cscales_v, sink, idx, SCALE)
    assert rec.copies == [], f"the op copied: {rec.copies}"
    ref = A.sparse_attn_packed_ref(q, window, scales, codes, cscales, sink, idx_ref, SCALE)
    check(out, ref, decoded_rows(window, scales, codes, cscales, dtype), q, k, SCALE, seed)
    assert torch.equal(out, A.sparse_attn_packed(q, window, scales, codes, cscales, sink, idx, SCALE)), seed


def test_empty_list_and_out_of_range():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 4, D_CPU, generator=g)
    kv = torch.randn(1, 10, D_CPU, generator=g)
    sink = torch.randn(4, generator=g)
    assert (A.sparse_attn(q, kv, sink, torch.zeros(1, 2, 0, dtype=torch.int32), SCALE) == 0).all()
    idx = torch.tensor([[[3, 12, -1], [5, 6, 10]]], dtype=torch.int32)  # 10 and 12 are past the rows
    out = A.sparse_attn(q, kv, sink, idx, SCALE)
    ref = A.sparse_attn_ref(q, kv, sink, torch.where(idx < 10, idx, -1), SCALE)
    # the kernel's fp32 sums run in another order than the reference's: 1e-5, as for every list
    # (1e-6 failed once in CI at 1.2e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_bad_arguments():
    q = torch.randn(1, 2, 4, 64)
    kv = torch.randn(1, 10, 64)
    sink = torch.randn(4)
    idx = torch.zeros(1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv"):
        A.sparse_attn(q, kv.bfloat16(), sink, idx, 0.125)
    with pytest.raises(ValueError, match="idx"):
        A.sparse_attn(q, kv, sink, idx.long(), 0.125)
    with pytest.raises(ValueError, match="comp_scales"):
        A.sparse_attn_packed(q, kv, None, torch.zeros(1, 5, 32, dtype=torch.uint8),
                             torch.zeros(1, 5, 3, dtype=torch.uint8), sink, idx, 0.125)


def test_opcheck():
    g = torch.Generator().manual_seed(fresh_seed())
    b, s, h, d, n_w, n_c, k = 1, 2, 4, D_CPU, 20, 100, 70
    for dtype, fp8 in (PACKED_CASES[0], PACKED_CASES[2]):  # window rows (scales None) and the FP8 ring
        args = packed_inputs(b, s, h, d, n_w, n_c, k, dtype, fp8, g)
        torch.library.opcheck(torch.ops.dsv41c.sparse_attn_packed.default, (*args, SCALE))
    q = torch.randn(2, 3, 4, D_CPU, generator=g)
    kv = torch.randn(2, 150, D_CPU, generator=g)
    torch.library.opcheck(torch.ops.dsv41c.sparse_attn.default,
                          (q, kv, torch.randn(4, generator=g), make_idx(2, 3, 140, 150, g), SCALE))


def test_compiles_fullgraph():
    g = torch.Generator().manual_seed(fresh_seed())
    q = torch.randn(2, 3, 4, D_CPU, generator=g)
    kv = torch.randn(2, 150, D_CPU, generator=g)
    sink, idx = torch.randn(4, generator=g), make_idx(2, 3, 140, 150, g)
    fn = torch.compile(lambda *a: A.sparse_attn(*a, SCALE), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q, kv, sink, idx), A.sparse_attn(q, kv, sink, idx, SCALE), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- the pass

class OneAttention(nn.Module):
    def __init__(self, h, d):
        super().__init__()
        self.attn_sink = nn.Parameter(torch.randn(h))
        self.scale = d**-0.5

    def forward(self, q, kv, idx):
        return eager_sparse_attn(q, kv, self.attn_sink, idx, self.scale)


class ThreeAttentions(nn.Module):
    """Plain rows; a packed FP8 ring + FP4 compressed rows (as fp4_kv leaves a decode step's
    reads); the ring alone.  The first and last share an index list (CSE shares its decoding)."""

    def __init__(self, h, d):
        super().__init__()
        self.plain, self.packed, self.ring = (OneAttention(h, d) for _ in range(3))

    def forward(self, q, kv, wc, ws, cc, cs, idx, idx_w):
        ring = tq.fp8_dequant(wc, ws, q.dtype)
        rows = torch.cat([ring, tq.fp4_e4m3_dequant(cc, cs, q.dtype)], dim=1)
        return self.plain(q, kv, idx_w) + self.packed(2 * q, rows, idx) + self.ring(q, ring, idx_w)


def three_attentions_inputs(h, d, seed, n_w=10, n_c=30):
    """ThreeAttentions' inputs: batch 2, 3 queries, n_w plain/window rows and n_c compressed rows."""
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(2, 3, h, d, generator=g), torch.randn(2, n_w, d, generator=g)
    wc, ws = Q.fp8_quant_ref(torch.randn(2, n_w, d, generator=g))
    cc, cs = Q.fp4_e4m3_quant_ref(torch.randn(2, n_c, d, generator=g))
    return q, kv, wc, ws, cc, cs, make_idx(2, 3, 70, n_w + n_c, g), make_idx(2, 3, 20, n_w, g)


def test_lower_sparse_attn_pass():
    """Each eager sparse_attn site becomes one kernel call (the packed ones read the bytes), and
    the lowered graph computes what eager does."""
    from dsv41c.compiler import dynamo_backend, inductor_options

    seed = fresh_seed()
    model = ThreeAttentions(4, D_CPU)
    pipe = PassPipeline([LowerSparseAttn()], strict=True)
    pipe.bind(model)
    args = three_attentions_inputs(4, D_CPU, seed)
    fn = torch.compile(model, backend=dynamo_backend("passes_only"), fullgraph=True, dynamic=True)
    with torch.no_grad(), torch._inductor.config.patch(inductor_options(pipe)):
        out = fn(*args)
        ref = model(*args)
    stats = pipe.stats["lower_sparse_attn"]
    assert sorted(stats.details) == ["sparse_attn at plain", "sparse_attn_packed at packed",
                                     "sparse_attn_packed at ring"], stats.details
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_lower_sparse_attn_leaves_packed_rows_it_cannot_take(monkeypatch):
    """Packed rows of a head dim the packed build does not take (on CUDA: not a multiple of 128,
    as tiny's 64) stay as torch ops on fp4_kv's dequantised rows, with a warning, and still compute
    what eager does; the plain site is lowered as usual. Stands in for CUDA on the CPU by making
    every head dim unsupported."""
    from dsv41c.compiler import dynamo_backend, inductor_options

    monkeypatch.setattr(A, "packed_head_dim_problem", lambda d, cuda: f"no packed build for d={d} here")
    seed = fresh_seed()
    model = ThreeAttentions(4, D_CPU)
    pipe = PassPipeline([LowerSparseAttn()])
    pipe.bind(model)
    args = three_attentions_inputs(4, D_CPU, seed)
    fn = torch.compile(model, backend=dynamo_backend("passes_only"), fullgraph=True, dynamic=True)
    left = r"2 site.* left as torch ops.*packed rows: no packed build for d=\d+"
    with pytest.warns(UserWarning, match=left), torch.no_grad(), torch._inductor.config.patch(inductor_options(pipe)):
        out = fn(*args)
    ref = model(*args)
    stats = pipe.stats["lower_sparse_attn"]
    assert [x for x in stats.details if not x.startswith("left: ")] == ["sparse_attn at plain"], stats.details
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_lower_sparse_attn_strict_failure():
    """An fp32 site whose rows are bf16 is left as torch ops: an error in strict mode."""
    from dsv41c.compiler import dynamo_backend, inductor_options

    model = OneAttention(4, 64)
    pipe = PassPipeline([LowerSparseAttn()], strict=True)
    pipe.bind(model)
    fn = torch.compile(model, backend=dynamo_backend("passes_only"), fullgraph=True)
    q, kv = torch.randn(1, 2, 4, 64), torch.randn(1, 5, 64).bfloat16()
    with pytest.raises(Exception, match="left as torch ops") as info, torch.no_grad(), \
            torch._inductor.config.patch(inductor_options(pipe)):
        fn(q, kv, torch.zeros(1, 2, 3, dtype=torch.int32))
    assert isinstance(info.value, PassError) or "PassError" in str(info.value)


def compile_lowered(model, passes):
    """dsv41c.compile with `passes` then lower_sparse_attn (strict, passes_only backend, graphs kept)."""
    import dsv41c

    return dsv41c.compile(model, passes=(*passes, "lower_sparse_attn"), strict=True, backend="passes_only",
                          keep_code=True)


@pytest.mark.slow
def test_lower_sparse_attn_whole_model(tmp_path_factory):
    """The 3-layer tiny cut (Full, Reindex, Reuse), fp32 with kv_quant, compiled with fp4_kv and
    lower_sparse_attn: every layer's attention is one kernel call reading the packed caches (the
    decode step's window from the FP8 ring), and greedy tokens and logits follow eager kv_quant."""
    from conftest import THREE_KINDS, record_tiny_cut

    from dsv41c import golden
    from dsv41c.weights import build_model

    steps = 4
    path = record_tiny_cut(tmp_path_factory.mktemp("sparse"), "sparse", steps, **THREE_KINDS, hc_sinkhorn_iters=1,
                           candidate_block_size=1, engram_layer_ids=[], engram_num_embeddings=[])
    g = golden.load_golden(path)
    torch._dynamo.reset()
    model = build_model(g.args, seed=g.seed, dtype=torch.float32, kv_quant=True)
    compiled = compile_lowered(model, ("fp4_kv",))
    eager = build_model(g.args, seed=g.seed, dtype=torch.float32, kv_quant=True)
    eager_trace, eager_tokens = golden.run_greedy(eager, g.inputs, steps)
    trace, tokens = golden.run_greedy(compiled, g.inputs, steps)
    assert torch.equal(tokens, eager_tokens)
    for a, b in ((trace.prefill_logits, eager_trace.prefill_logits),
                 (trace.decode_logits, eager_trace.decode_logits)):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()    # DESIGN.md: fp4_kv vs eager kv_quant
    n = model.args.n_layers
    for graph, op in ((1, "sparse_attn_packed"), (2, "sparse_attn_packed")):
        snaps = {s.stage: s for s in compiled.snapshots if s.graph == graph}
        after = snaps["lower_sparse_attn"].code
        assert after.count(f"torch.ops.dsv41c.{op}.default(") == n, graph
        # the eager scores and values einsums of every layer are gone
        assert snaps["lower_sparse_attn"].counts.batched_gemms == snaps["fp4_kv"].counts.batched_gemms - 2 * n
        for codec in ("fp4_e4m3_dequant", "fp8_dequant"):                          # the kernels read the bytes
            assert f"torch.ops.dsv41c.{codec}.default(" not in after, (graph, codec)
    assert compiled.pipeline.stats["lower_sparse_attn"].matches == 2 * n


def compiles_without_spills(source: str, tmp_path) -> None:
    """Where nvcc is found (PATH, or CUDA_HOME/bin): the lowered CUDA source compiles to an sm_90a
    cubin without register spills."""
    import os
    import re
    import shutil
    import subprocess

    import tilelang
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (cuda_home and shutil.which("nvcc", path=os.path.join(cuda_home, "bin")))
    if not nvcc:
        return
    root = os.path.dirname(tilelang.__file__)
    (tmp_path / "k.cu").write_text(source)
    out = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "-DENABLE_BF16", "-w", "-Xptxas", "-v",
                          f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include", "-o", str(tmp_path / "k.cubin"),
                          str(tmp_path / "k.cu")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"\b0 bytes spill stores", out.stderr), out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True, "pair"], ids=["direct", "split", "pair"])
@pytest.mark.parametrize("kind", [*A.KINDS, "combine"])
def test_cuda_build_lowers_for_sm90a(kind, split, tmp_path):
    """Without a GPU: each CUDA build at the released dims (whole-list, split, and split merged by
    clusters of two; the combine once) lowers for sm_90a (wgmma GEMMs, cp.async gathers; the pair
    merge's cluster barriers and distributed shared memory loads), and where nvcc is found (PATH,
    or CUDA_HOME/bin) it compiles to a cubin without register spills."""
    import tvm
    from tilelang.engine import lower

    if kind == "combine" and split:
        pytest.skip("one combine build")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    fn = (A.combine_prim_func(64, 512) if kind == "combine"
          else A.attention_prim_func(kind, "bfloat16", 64, 512, 512**-0.5, "cuda", bool(split), split == "pair"))
    with target:
        source = lower(fn, target=target).kernel_source
    if kind != "combine":
        assert "wgmma" in source and "cp_async_gs<16>" in source
    body = source[source.index("__global__ void"):]
    assert (body.count("dsv41c_cluster_sync();") == 2 and "dsv41c_ld_peer4(" in body) == (split == "pair")
    compiles_without_spills(source, tmp_path)


@pytest.mark.slow
def test_pair_group_variant_lowers_for_sm90a(monkeypatch, tmp_path):
    """Without a GPU: the split kernel with the pair merge's loads in one group of 16 items (a tuning
    of `_PAIR_GROUP`) lowers for sm_90a with that loop, and compiles without spills where nvcc is
    found."""
    import re

    import tvm
    from tilelang.engine import lower
    monkeypatch.setattr(A, "_PAIR_GROUP", 16)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        source = lower(A.attention_prim_func("packed_fp8", "bfloat16", 64, 512, 512**-0.5, "cuda", True, True),
                       target=target).kernel_source
    body = source[source.index("__global__ void"):]
    # one group: the loads of 16 items (both CTAs' max, sum and 4 columns each) in one loop
    assert re.search(r"for \(int (k_\d+) = 0; \1 < 16; \+\+\1\) \{\s*#pragma unroll\s*"
                     r"for \(int j = 0; j < 2; \+\+j\) \{\s*ml\[[^\n]*dsv41c_ld_peer", body)
    compiles_without_spills(source, tmp_path)


def test_combine_launch_for_sm90a():
    """Without a GPU: the combine kernel is launched programmatically (the tag in its launch
    parameters) and waits for the split kernel's partials before it reads any. (The split
    kernel's trigger: the GPU tests, whose builds lower it.)"""
    import tilelang
    from dsv41c.tilelang_kernels.quant import PDL_TAG, cuda_pass_configs

    fn = A.combine_prim_func(64, 512)
    tgt = {"kind": "cuda", "arch": "sm_90a"}
    with tilelang.tvm.transform.PassContext(config=cuda_pass_configs(fn)), tilelang.tvm.target.Target(tgt):
        art = tilelang.lower(fn, target=tgt)
    tags = [str(t) for f in art.device_mod.functions.values() for t in f.attrs["tirx.kernel_launch_params"]]
    body = art.kernel_source[art.kernel_source.index("__global__ void"):]
    assert PDL_TAG in tags and body.count("cudaGridDependencySynchronize();") == 1
    assert body.index("cudaGridDependencySynchronize();") < body.index("MP[")


def test_num_splits():
    """The split plan: no split once the query-head groups fill the SMs; otherwise one wave of CTAs,
    each with the fewest blocks, and no split left empty by the kernel's ceil(blocks / NS) runs."""
    assert A.num_splits(1, 10, 132) == 10
    assert A.num_splits(32, 10, 132) == 4  # 3 + 3 + 3 + 1 blocks, 128 CTAs
    assert A.num_splits(20, 10, 132) == 5
    assert A.num_splits(132, 10, 132) == 1 and A.num_splits(192, 4, 132) == 1 and A.num_splits(5, 1, 132) == 1
    # the pair merge: an even split whose CTAs walk at least 2 blocks (b32), not b1's 10 x 1, nor
    # an odd split, nor none
    assert A.pair_merged(4, 10) and A.pair_merged(2, 4)
    assert not A.pair_merged(10, 10) and not A.pair_merged(5, 10) and not A.pair_merged(1, 10)
    for sms in (1, 7, 132):
        for ctas in range(1, 2 * sms + 2):
            for blocks in range(1, 41):
                ns = A.num_splits(ctas, blocks, sms)
                per = -(-blocks // ns)
                assert 1 <= ns <= blocks and (ns == 1 or ctas * ns <= sms), (ctas, blocks, sms, ns)
                assert (ns - 1) * per < blocks, (ctas, blocks, sms, ns)


# ------------------------------------------------------------------------------------- GPU

def splits_of(b, s, h, k):
    """CTAs per query the CUDA call at these shapes uses (1: the whole list in one CTA)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return A.num_splits(b * s * -(-h // 64), -(-k // A.BLOCK), sms)


def past_the_rows(idx, n_rows, g):
    """idx with about 1/20 of its entries moved past the rows (the kernels ignore them like -1), and
    the list the references get (those entries -1)."""
    far = torch.rand(idx.shape, generator=g) < 0.05
    idx = torch.where(far.to(idx.device), n_rows + 7, idx)
    return idx, torch.where(idx < n_rows, idx, -1)


def decode_inputs(b, h, d, n_c, g, window=128, topk=512, holes=True):
    """One decode query per sequence over an FP8 ring of `window` slots and n_c FP4 compressed rows:
    the ring list oldest first with the unfilled slots -1 for sequence 0, then topk ascending
    compressed entries (offset by the window) with a few -1 (spec §6.3, §6.5).  With b > 1 the last
    sequence's list is all -1 (its output must be 0).  holes False: every entry valid (a full ring,
    no -1), as in a long decode, so that every block holds one kind of row."""
    q, ring, ring_scales, codes, cscales, sink, _ = packed_inputs(b, 1, h, d, window, n_c, 1, torch.bfloat16,
                                                                  True, g)
    slots = torch.arange(window).repeat(b, 1)
    top = torch.rand(b, n_c, generator=g).topk(topk, dim=-1).indices.sort(dim=-1).values + window
    if holes:
        slots[0, window // 2:] = -1
        top = torch.where(torch.rand(b, topk, generator=g) < 0.05, -1, top)
    idx = torch.cat([slots, top], dim=-1).int().unsqueeze(1)
    if b > 1 and holes:
        idx[-1] = -1
    return tuple(t.cuda() for t in (q, ring, ring_scales, codes, cscales, sink, idx))


@pytest.mark.parametrize("batch,topk", [(1, 512), (32, 512), (20, 472), (7, 72), (140, 512)],
                         ids=["b1", "b32", "b20-ragged", "b7-short", "b140-whole"])
@pytest.mark.gpu
@needs_cuda
def test_sparse_attn_packed_released_dims_gpu(batch, topk):
    """Decode at the released dims: H=64, d=512, K = 128 window + top-k entries, the compressed rows
    a strided view of a larger cache buffer (entries past them name rows of the buffer).  b1 and b32 are the
    benchmark's cases (10 splits of 1 block; 4 splits of 3, 3, 3, 1 blocks); b20 and b7 end the list
    inside a block (5 splits of 2 blocks; 4 of 1); b140 fills the SMs without a split.  Some entries
    point past the rows; the last sequence has no valid entry."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    h, d, n_c = 64, 512, 4096
    k = 128 + topk
    assert (splits_of(batch, 1, h, k) > 1) == (batch < 132), "the case exercises the intended path"
    q, ring, ring_scales, codes, cscales, sink, idx = decode_inputs(batch, h, d, n_c, g, topk=topk)
    idx, idx_ref = past_the_rows(idx, 128 + n_c, g)
    scale = d**-0.5
    # the compressed rows as a cache read (a strided view of a larger buffer, passed uncopied)
    out = A.sparse_attn_packed(q, ring, ring_scales, cache_read(codes, n_c + 64, batch + 1),
                               cache_read(cscales, n_c + 64, batch + 1), sink, idx, scale)
    ref = A.sparse_attn_packed_ref(q, ring, ring_scales, codes, cscales, sink, idx_ref, scale)
    rows = decoded_rows(ring, ring_scales, codes, cscales, torch.bfloat16)
    check(out, ref, rows, q, k, scale, seed, empty_first=False)
    assert batch == 1 or (out[-1] == 0).all(), f"seed {seed}: a query with no valid entry must return 0"
    plain = A.sparse_attn(q, rows, sink, idx, scale)
    assert torch.equal(plain, out), f"seed {seed}: the plain and packed kernels read the same rows"


@pytest.mark.parametrize("batch", [32, 1, 7, 20], ids=["b32", "b1", "b7-short", "b20-odd"])
@pytest.mark.gpu
@needs_cuda
def test_pair_merge_gpu(batch, monkeypatch):
    """The pair merge (`pair_merged`): b32's split (4 CTAs of 3, 3, 3, 1 blocks) runs in clusters of
    two that merge their partials on chip, half as many for the combine; b1 (10 CTAs of 1 block)
    and b7 (4 of 1) do so with `_PAIR_MIN_BLOCKS` 1; b20's 5 CTAs (odd) take the plain split.
    Against the reference, and against the plain split within the same bound (the merge's two
    levels round the fp32 sums in another order)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    h, d, n_c = 64, 512, 4096
    topk = 72 if batch == 7 else 472 if batch == 20 else 512
    q, ring, ring_scales, codes, cscales, sink, idx = decode_inputs(batch, h, d, n_c, g, topk=topk)
    k, scale = 128 + topk, d**-0.5
    monkeypatch.setattr(A, "_PAIR_MIN_BLOCKS", 1 << 30)
    split = A.sparse_attn_packed(q, ring, ring_scales, codes, cscales, sink, idx, scale)
    monkeypatch.setattr(A, "_PAIR_MIN_BLOCKS", 2 if batch == 32 else 1)  # b32: the default
    assert A.pair_merged(splits_of(batch, 1, h, k), -(-k // A.BLOCK)) == (batch != 20), "the intended path"
    out = A.sparse_attn_packed(q, ring, ring_scales, codes, cscales, sink, idx, scale)
    ref = A.sparse_attn_packed_ref(q, ring, ring_scales, codes, cscales, sink, idx, scale)
    rows = decoded_rows(ring, ring_scales, codes, cscales, torch.bfloat16)
    check(out, ref, rows, q, k, scale, seed, empty_first=False)
    check(out, split, rows, q, k, scale, seed, empty_first=False)
    assert batch == 1 or (out[-1] == 0).all(), f"seed {seed}: a query with no valid entry must return 0"
    if batch == 20:
        assert torch.equal(out, split), f"seed {seed}: an odd split is the plain split"


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-ring", "bf16-window"])
@pytest.mark.parametrize("batch", [32, 140], ids=["b32-split", "b140-whole"])
@pytest.mark.gpu
@needs_cuda
def test_sparse_attn_packed_full_lists_gpu(batch, fp8):
    """Decode lists without -1 entries (a full ring and top-k valid rows, the benchmark's case): each
    64-entry block then holds only window rows or only compressed rows, the blocks the kernel
    decodes without a per-row branch; with an FP8 ring, and with bf16 window rows (the packed_rows
    build, whose compressed codes come from a bf16-typed stage)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    h, d, n_c = 64, 512, 4096
    q, ring, ring_scales, codes, cscales, sink, idx = decode_inputs(batch, h, d, n_c, g, holes=False)
    if not fp8:
        ring, ring_scales = Q.fp8_dequant_ref(ring, ring_scales, torch.bfloat16), None
    scale = d**-0.5
    out = A.sparse_attn_packed(q, ring, ring_scales, codes, cscales, sink, idx, scale)
    ref = A.sparse_attn_packed_ref(q, ring, ring_scales, codes, cscales, sink, idx, scale)
    rows = decoded_rows(ring, ring_scales, codes, cscales, torch.bfloat16)
    check(out, ref, rows, q, 128 + 512, scale, seed, empty_first=False)
    assert torch.equal(A.sparse_attn(q, rows, sink, idx, scale), out), f"seed {seed}: plain and packed differ"


@pytest.mark.parametrize("s", [96, 3], ids=["whole", "split"])
@pytest.mark.gpu
@needs_cuda
def test_sparse_attn_packed_prefill_gpu(s):
    """A prefill chunk: fresh bf16 window rows and FP4 compressed rows, H=64, d=512; 2 x 96 queries
    fill the SMs (one CTA per query), 1 x 3 queries split their 200-entry lists (4 blocks)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, h, d, n_w, n_c, k = 2 if s > 3 else 1, 64, 512, 96, 300, 200
    assert (splits_of(b, s, h, k) > 1) == (s == 3)
    inputs = packed_inputs(b, s, h, d, n_w, n_c, k, torch.bfloat16, False, g)
    q, window, _, codes, cscales, sink, idx = (None if t is None else t.cuda() for t in inputs)
    idx, idx_ref = past_the_rows(idx, n_w + n_c, g)
    scale = d**-0.5
    out = A.sparse_attn_packed(q, window, None, codes, cscales, sink, idx, scale)
    ref = A.sparse_attn_packed_ref(q, window, None, codes, cscales, sink, idx_ref, scale)
    check(out, ref, decoded_rows(window, None, codes, cscales, torch.bfloat16), q, k, scale, seed)


@pytest.mark.parametrize("s", [5, 40])
@pytest.mark.parametrize("h,d", [(4, 128), (72, 64)])
@pytest.mark.gpu
@needs_cuda
def test_sparse_attn_small_heads_gpu(h, d, s):
    """Head counts that are not a multiple of the CTA's 64 heads (padded GEMM rows), with the lists
    split over CTAs (5 queries; 40 queries of 4 heads) or not (2 x 40 queries x 2 head groups fill
    the SMs)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, n, k = 2, 150, 140
    q = torch.randn(b, s, h, d, generator=g).bfloat16().cuda()
    kv = (torch.randn(b, n, d, generator=g) * 2).bfloat16().cuda()
    sink, idx = torch.randn(h, generator=g).cuda(), make_idx(b, s, k, n, g, "cuda")
    scale = d**-0.5
    out = A.sparse_attn(q, kv, sink, idx, scale)
    check(out, A.sparse_attn_ref(q, kv, sink, idx, scale), kv, q, k, scale, seed)


@pytest.mark.gpu
@needs_cuda
def test_opcheck_gpu():
    g = torch.Generator().manual_seed(fresh_seed())
    args = decode_inputs(2, 64, 512, 1024, g)
    torch.library.opcheck(torch.ops.dsv41c.sparse_attn_packed.default, (*args, 512**-0.5))
    with pytest.raises(ValueError, match="bf16"):
        A.sparse_attn(args[0].float(), torch.randn(2, 10, 512, device="cuda"), args[5], args[6], 0.125)
    q64 = args[0][..., :64].contiguous()
    with pytest.raises(ValueError, match="multiple of 128"):
        A.sparse_attn_packed(q64, args[1][..., :64].contiguous(), args[2][..., :2].contiguous(),
                             args[3][..., :32].contiguous(), args[4][..., :4].contiguous(), args[5], args[6], 0.125)


def test_packed_head_dims():
    """What `sparse_attn_packed` takes, in one place for the op and lower_sparse_attn (which leaves
    a site it cannot take to fp4_kv's dequantised rows): 32-multiples on the CPU build, 128-multiples
    on CUDA (tiny's 64 is CPU-only)."""
    from dsv41c.tilelang_kernels.attention import packed_head_dim_problem
    assert packed_head_dim_problem(64, cuda=False) is None and packed_head_dim_problem(512, cuda=True) is None
    assert "128" in packed_head_dim_problem(64, cuda=True)
    assert "32" in packed_head_dim_problem(48, cuda=False) and "32" in packed_head_dim_problem(48, cuda=True)


def test_benchmark_ablations_replace_only_their_functions(monkeypatch):
    """benchmarks/attention.py --ablate (timing only) swaps the bodies of the named prelude functions
    and nothing else of the preludes, and the packed kernel (split, pair merge) still lowers with
    both ablations in place."""
    import sys
    from pathlib import Path

    import tvm
    from tilelang.engine import lower
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "attention", raising=False)
    import attention as BA
    for var in {v for parts in BA._ABLATIONS.values() for v, _, _ in parts}:
        monkeypatch.setattr(A, var, getattr(A, var))  # restored after the test
    for part, swaps in BA._ABLATIONS.items():
        before = {var: getattr(A, var) for var, _, _ in swaps}
        BA.ablate(part)
        for var, fn, body in swaps:
            src, new = before[var], getattr(A, var)
            head = src[:src.index("{", src.index(f"void {fn}(")) + 1]
            tail = src[src.index("\n}\n", len(head)) + 3:]
            assert new.startswith(head) and body in new, (part, fn)
            before[var] = head + body + tail
        assert all(getattr(A, var) == want for var, want in before.items()), part
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        source = lower(A.attention_prim_func("packed_fp8", "bfloat16", 64, 512, 512**-0.5, "cuda", True, True),
                       target=target).kernel_source
    prelude = source[:source.index("__global__ void")]
    assert "alpha[0] = 1.0f;" in prelude and "bar.sync 8, 256;" in prelude  # (dsv41c_row_total keeps its own)
    assert "(c >> 2) & 0x3F3F3F3Fu" in prelude and "dsv41c_e2m1_words(*" not in prelude
    assert "dsv41c_trace" not in source  # (no trace marks unless `_TRACE` is set)


def test_trace_marks_every_phase_once_in_time_order(monkeypatch):
    """benchmarks/attention.py --trace: with `_TRACE` set to a buffer address, the CUDA split kernel
    (pair merge) calls dsv41c_trace at each mark of `_TRACE_MARKS` in the order the dict lists them,
    the block marks inside the loop for its first `_TRACE_BLOCKS` blocks; the slots fit a CTA's row."""
    import re

    import tvm
    from tilelang.engine import lower
    slots = [*A._TRACE_MARKS, A._TRACE_SM, A._TRACE_T0, A._TRACE_T1]
    assert len(set(slots)) == len(slots) and max(slots) < A.TRACE_SLOTS
    monkeypatch.setattr(A, "_TRACE", 0x7F0012340000)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        source = lower(A.attention_prim_func("packed_fp8", "bfloat16", 64, 512, 512**-0.5, "cuda", True, True),
                       target=target).kernel_source
    assert f"reinterpret_cast<long long*>({0x7F0012340000}ull)" in source
    body = source[source.index("__global__ void"):]
    calls = re.findall(r"dsv41c_trace(_timer)?\((.*?)\);\n", body)
    loop = re.search(r"\((\w+) < 4\)\) \{\s*dsv41c_trace", body).group(1)
    block = [("", f"(({loop} * 5) + {3 + k})") for k in range(5)]
    marks = [("", "0"), ("_timer", "30"), ("", "1"), ("", "2"), *block, ("", "28"), ("", "23"), ("", "24"),
             ("", "25"), ("", "29"), ("_timer", "31")]
    assert calls == marks, calls
    assert body.count("dsv41c_trace") == len(marks)
    assert list(A._TRACE_MARKS) == [0, 1, 2, *range(3, 3 + 5 * A._TRACE_BLOCKS), 28, 23, 24, 25, 29]


def test_trace_table_measures_each_mark_from_the_previous_one_of_its_chain(monkeypatch, capsys):
    """benchmarks/quant.py trace_table on a hand-made trace of two CTAs of the attention kernel, one
    of three blocks and one of one: each phase is the cycles since the CTA's previous mark (block 1's
    marks only where the CTA has them; the loop's end from each CTA's last block), and the CTA count,
    the SMs and the timer's spreads come from their slots."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "quant", raising=False)
    from quant import trace_table
    rows = torch.zeros(2, A.TRACE_SLOTS, dtype=torch.int64)
    for cta, nblocks in ((0, 3), (1, 1)):
        clock = 1000 + 7 * cta
        marks = [0, 1, 2, *range(3, 3 + 5 * nblocks), 28, 29]
        for k in marks:
            rows[cta, k] = clock
            clock += 10 * (k + 1)  # the phase ending at the next mark: 10 (its slot + 1) cycles
        rows[cta, A._TRACE_SM] = 5 + cta
        rows[cta, A._TRACE_T0], rows[cta, A._TRACE_T1] = 2000 + 100 * cta, 3000 + 500 * cta
    trace_table(rows, A, 0, 29)
    out = capsys.readouterr().out
    assert out.startswith("2 CTAs on 2 SMs; global timer: starts spread over 0.10 us, ends over 0.50 us, "
                          "first start to last end 1.50 us; 0 CTAs started after the first one ended"), out
    lines = {ln.split(" | ")[0].lstrip("| "): ln.split(" | ")[1:] for ln in out.splitlines() if ln.startswith("| ")}
    assert lines["the first row numbers set"] == ["2", "10", "10 |"]  # mark 0's phase, both CTAs
    assert lines["block 0: copies landed"] == ["2", "30", "30 |"]  # after mark 2
    assert lines["block 1: copies landed"] == ["1", "80", "80 |"]  # after block 0's GEMM2 (mark 7)
    # the loop's end: after block 2's GEMM2 (mark 17: 180) and after block 0's (mark 7: 80); the
    # median of an even count is the lower middle value (torch's)
    assert lines["the loop's end (sums totalled)"] == ["2", "80", "180 |"]
    assert lines["the partial or o written"] == ["2", "290", "290 |"]
