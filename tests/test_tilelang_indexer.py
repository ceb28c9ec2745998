"""Indexer kernels (tilelang_kernels/indexer.py) against their refs and the eager indexer.

CPU tests run the C-target builds (each compiled once per process by `build`'s cache); `gpu` tests
run the CUDA builds and compare with the refs.  Inputs are fresh random every run (the seed is in
each failure message) with planted exact ties: queries with only non-negative entries against keys
with only non-positive ones score exactly 0, and duplicated key rows score identically.
"""

import secrets
import shutil

import pytest
import torch
from conftest import CopyRecorder, cache_read
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41c import quant
from dsv41c.attention import Indexer, top_indices
from dsv41c.tilelang_kernels import indexer as K

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def fresh_seed() -> int:
    return secrets.randbits(31)


def make_inputs(b, s, h, d, n, seed, *, fq=True, rows=None, device="cpu"):
    """(q, codes, scales, w) with planted ties; the key cache holds `rows` >= n rows."""
    g = torch.Generator().manual_seed(seed)
    rows = n + 3 if rows is None else rows
    q = torch.randn(b, s, h, d, generator=g)
    q[:, ::3] = q[:, ::3].abs()  # every third query: no negative entry
    keys = torch.randn(b, rows, d, generator=g) * torch.rand(b, rows, 1, generator=g).mul(4).exp2()
    keys[:, 1::4] = -keys[:, 1::4].abs()  # every fourth key: no positive entry -> exact 0 scores
    keys[:, torch.randint(0, rows, (rows // 3,), generator=g)] = keys[:, :1].clone()  # equal scores
    q = q.bfloat16()
    q = quant.fp4_ue8m0_fake_quant(q, 32) if fq else q
    codes, scales = quant.mxfp4_quant_ref(keys.bfloat16())
    w = (torch.randn(b, s, h, generator=g) * d ** -0.5).bfloat16()
    return tuple(t.to(device) for t in (q, codes, scales, w))


def prefill_visible(s, ratio, device="cpu"):
    return ((torch.arange(s, device=device) + 1) // ratio).int()


def same(a, b):
    """Equal values (NaN never passes), -inf included."""
    return a.shape == b.shape and a.dtype == b.dtype and not a.isnan().any() and torch.equal(a, b)


# ----------------------------------------------------------------------------------- CPU

H, D = 4, 128  # CPU: one head count and the released head dim, so each flag set builds once
SCORE_CASES = {  # name: (B, S, n, ratio or None for decode)
    "prefill": (2, 13, 13, 1),
    "prefill_ratio4": (1, 30, 7, 4),
    "decode": (3, 1, 45, None),
    "decode_multi_query": (2, 3, 20, None),
}


@pytest.mark.parametrize("block_max", (False, True), ids=["scores", "blockmax"])
@pytest.mark.parametrize("with_cand", (False, True), ids=["all", "cand"])
@pytest.mark.parametrize("case", SCORE_CASES)
def test_scores_bit_exact_cpu(case, with_cand, block_max):
    b, s, n, ratio = SCORE_CASES[case]
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(b, s, H, D, n, seed)
    vl = prefill_visible(s, ratio) if ratio else None
    cand = None
    if with_cand:  # from the seed; block 0 kept: it holds planted zero scores (keys 1 and 5)
        cand = torch.rand(b, s, -(-n // 8), generator=torch.Generator().manual_seed(seed)) < 0.6
        cand[..., 0] = True
    got = K.index_scores(q, codes, scales, w, vl, cand, n=n, block_max=block_max)
    ref = K.index_scores_ref(q, codes, scales, w, vl, cand, n=n, block_max=block_max)
    assert same(got[0], ref[0]) and same(got[1], ref[1]), f"seed={seed}"
    assert (got[0] == 0).any(), f"seed={seed}: the planted zero scores are missing"


def test_cache_reads_go_in_uncopied_cpu():
    """Keys as the model passes them, `buf[:B, :n]` of a larger cache buffer: the op hands the
    kernel the buffer's rows without copying them (a copy costs the whole cache per call) and
    scores the same n keys."""
    seed = fresh_seed()
    b, s, n = 2, 1, 45
    q, codes, scales, w = make_inputs(b, s, H, D, n, seed, rows=n)
    codes_v, scales_v = cache_read(codes, 70, 3), cache_read(scales, 70, 3)
    assert not codes_v.is_contiguous()
    with CopyRecorder() as rec:
        got = K._scores_impl(q, codes_v, scales_v, w, None, None, n, True)
    assert rec.copies == [], f"the op copied: {rec.copies}"
    ref = K.index_scores_ref(q, codes, scales, w, None, None, n=n, block_max=True)
    assert same(got[0], ref[0]) and same(got[1], ref[1]), f"seed={seed}"


def test_scores_match_eager_indexer_cpu():
    """The ref is the eager §6.5(d): same bits as the eager Indexer's three lines on fake-quant keys."""
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(2, 9, H, D, 9, seed)
    keys = quant.mxfp4_dequant_ref(codes[:, :9], scales[:, :9], torch.bfloat16)
    eager = (torch.einsum("bshd,btd->bsht", q, keys).relu() * w.unsqueeze(-1)).sum(dim=2)
    got, _ = K.index_scores(q, codes, scales, w, n=9)
    assert same(got, eager), f"seed={seed}"


def test_scores_unquantised_queries_bound_cpu():
    """Plain bf16 queries: q.k is no longer exact in fp32, so the summation order can move a score
    by one bf16 rounding step: within 2^-7 relative of the largest score, and mostly equal."""
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(2, 4, H, D, 64, seed, fq=False)
    got, _ = K.index_scores(q, codes, scales, w, n=64)
    ref, _ = K.index_scores_ref(q, codes, scales, w, n=64)
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err <= 2 ** -7 and (got == ref).float().mean() > 0.95, f"seed={seed}: {err}"


def random_scores(b, s, n, seed, vl=None, masked=0.0):
    """bf16 scores drawn from few values (many ties), -inf past vl and on a `masked` fraction."""
    g = torch.Generator().manual_seed(seed)
    sc = (torch.randint(-6, 7, (b, s, n), generator=g).float() / 4).bfloat16()
    sc[torch.rand(b, s, n, generator=g) < 0.2] = 0.0
    sc[torch.rand(b, s, n, generator=g) < 0.05] = -0.0
    if masked:
        sc[torch.rand(b, s, n, generator=g) < masked] = float("-inf")
    if vl is not None:
        sc = sc.masked_fill(torch.arange(n) >= vl.view(-1, 1), float("-inf"))
    return sc


@pytest.mark.parametrize("masked", (0.0, 0.9), ids=["dense", "candmasked"])
@pytest.mark.parametrize("n,k", ((1, 1), (16, 5), (40, 40), (300, 17), (700, 512)))
def test_topk_bit_exact_cpu(n, k, masked):
    seed = fresh_seed()
    s = 6
    vl = torch.tensor([n, max(n - 3, 0), n // 2, 1, 0, n], dtype=torch.int32)
    sc = random_scores(2, s, n, seed, vl, masked)
    got = K.index_topk(sc, vl, k=k, offset=11)
    assert same(got, K.index_topk_ref(sc, vl, k=k, offset=11)), f"seed={seed}"
    assert ((got == -1) | ((got >= 11) & (got < n + 11))).all()
    valid = got.where(got >= 0, (1 << 30) + torch.arange(k, dtype=got.dtype))  # -1s come last
    assert (valid.diff(dim=-1) > 0).all(), f"seed={seed}: not ascending"


def test_topk_fill_quirk_cpu():
    """Fewer finite scores than k: the -inf fill takes candidate-masked visible entries (kept,
    with offset) before causally invisible ones (-1), lower indices first."""
    sc = torch.full((1, 1, 10), float("-inf"), dtype=torch.bfloat16)
    sc[0, 0, 4] = 1.0
    vl = torch.tensor([6], dtype=torch.int32)
    got = K.index_topk(sc, vl, k=8, offset=100)
    assert got.tolist() == [[[100, 101, 102, 103, 104, 105, -1, -1]]]


def test_topk_lower_index_wins_cpu():
    sc = torch.tensor([[[0.0, 1.0, 0.0, 1.0, -0.0, 1.0, 0.0]]], dtype=torch.bfloat16)
    vl = torch.tensor([7], dtype=torch.int32)
    assert K.index_topk(sc, vl, k=4, offset=0).tolist() == [[[0, 1, 3, 5]]]
    assert K.index_topk(sc, vl, k=5, offset=0).tolist() == [[[0, 1, 2, 3, 5]]]


@pytest.mark.parametrize("n,kb", ((5, 2048), (64, 3), (200, 7), (1000, 40)))
def test_funnel_bit_exact_cpu(n, kb):
    """Block max from the scoring kernel, then the funnel, against the eager candidate_mask."""
    seed = fresh_seed()
    s = 5
    q, codes, scales, w = make_inputs(1, s, H, D, n, seed)
    vl = torch.tensor([n, n - 1, 9, 1, 0], dtype=torch.int32)
    sc, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True)
    keep = K.candidate_blocks(bm, vl, topk_blocks=kb)
    assert same(keep, K.candidate_blocks_ref(bm, vl, topk_blocks=kb)), f"seed={seed}"
    funnel = type("Funnel", (), {"block_size": K.BLOCK, "topk_blocks": kb})()
    eager = Indexer.candidate_mask(funnel, sc.float(), vl.long())
    assert same(K.expand_blocks(keep, n), eager), f"seed={seed}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 400), k=st.integers(1, 40), extra=st.integers(1, 12),
       prefill=st.booleans(), masked=st.sampled_from([0.0, 0.5, 0.97]))
def test_funnel_flags_keep_the_topk_property(seed, n, k, extra, prefill, masked):
    """`funnel_keeps_topk`: with topk_blocks > k, the top-k of a row's scores only outside the funnel's
    kept blocks set to -inf (what index_topk computes given those flags) is the top-k of the row,
    ties, the pinned newest block, prefill rows (-inf past the visible length) and rows of fewer
    than k finite scores included.  Scores are drawn from few values, so ties are everywhere."""
    kb = k + extra
    assert K.funnel_keeps_topk(kb, k)
    s = 3 if prefill else 1
    vl = prefill_visible(s, 1) + max(0, n - s) if prefill else torch.tensor([n], dtype=torch.int32)
    sc = random_scores(2, s, n, seed, vl, masked)
    keep = K.candidate_blocks_ref(block_max_of(sc), vl, topk_blocks=kb)
    only_kept = sc.masked_fill(~K.expand_blocks(keep, n), float("-inf"))
    assert same(K.index_topk_ref(only_kept, vl, k=k, offset=0), K.index_topk_ref(sc, vl, k=k, offset=0))


def test_funnel_flags_with_too_few_blocks_can_miss_the_topk():
    """The bound is needed: keeping k blocks (the pinned newest among them) can drop a top-k entry."""
    assert not K.funnel_keeps_topk(2, 2)
    sc = torch.zeros(1, 1, 24, dtype=torch.bfloat16)
    sc[0, 0, 3], sc[0, 0, 12] = 5.0, 4.0  # the top 2, in blocks 0 and 1; block 2 is the newest
    vl = torch.tensor([24], dtype=torch.int32)
    keep = K.candidate_blocks_ref(block_max_of(sc), vl, topk_blocks=2)
    assert keep.tolist() == [[[True, False, True]]]
    only_kept = sc.masked_fill(~K.expand_blocks(keep, 24), float("-inf"))
    assert K.index_topk_ref(sc, vl, k=2, offset=0).tolist() == [[[3, 12]]]
    assert K.index_topk_ref(only_kept, vl, k=2, offset=0).tolist() == [[[0, 3]]]  # entry 12 lost


def test_funnel_ties_cpu():
    """Equal block maxima: lower block index wins; the newest block is pinned; -inf never kept."""
    bm = torch.tensor([[[2.0, 5.0, 5.0, 5.0, 1.0, float("-inf"), float("-inf")]]], dtype=torch.bfloat16)
    vl = torch.tensor([33], dtype=torch.int32)  # newest block (33-1)//8 = 4
    assert K.candidate_blocks(bm, vl, topk_blocks=3).tolist() == [[[False, True, True, False, True, False, False]]]
    assert K.candidate_blocks(bm, vl, topk_blocks=7).tolist() == [[[True] * 5 + [False] * 2]]


def test_reindex_chain_cpu():
    """Candidate source -> funnel -> a Reindex layer's masked scores and top-k, all kernels,
    against the eager composition with the lower-index tie rule."""
    seed = fresh_seed()
    b, s, n, k, kb = 2, 40, 40, 24, 2
    q, codes, scales, w = make_inputs(b, s, H, D, n, seed)
    q2, _, _, w2 = make_inputs(b, s, H, D, n, seed + 1)
    vl = prefill_visible(s, 1)
    _, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True)
    keep = K.candidate_blocks(bm, vl, topk_blocks=kb)
    sc, _ = K.index_scores(q2, codes, scales, w2, vl, keep, n=n)
    got = K.index_topk(sc, vl, k=k, offset=s)
    ref_sc, _ = K.index_scores_ref(q, codes, scales, w, vl, n=n)
    funnel = type("Funnel", (), {"block_size": K.BLOCK, "topk_blocks": kb})()
    mask = Indexer.candidate_mask(funnel, ref_sc.float(), vl.long())
    ref_sc2, _ = K.index_scores_ref(q2, codes, scales, w2, vl, n=n)
    ref_sc2 = ref_sc2.masked_fill(~mask, float("-inf"))
    idx = top_indices(ref_sc2.float(), k).sort(dim=-1).values
    ref = torch.where(idx >= vl.view(1, s, 1), -1, idx + s).int()
    assert same(got, ref), f"seed={seed}"
    # given the flags (as lower_indexer passes them) the C build reads the whole row all the same
    assert same(K.index_topk(sc, vl, keep, k=k, offset=s), ref), f"seed={seed}"


@pytest.mark.parametrize("block", (1, 4, 5))
def test_other_block_sizes_cpu(block):
    """Candidate blocks of other than 8 entries (tiny's are 4): the C builds' block maxima, masked
    scores, funnel and top-k given the flags, against the refs with the same block size and the
    eager Indexer's candidate_mask; a prefill whose last block is partial for every size here."""
    seed = fresh_seed()
    b, s, n, k, kb = 2, 23, 23, 6, 3
    q, codes, scales, w = make_inputs(b, s, H, D, n, seed)
    q2, _, _, w2 = make_inputs(b, s, H, D, n, seed + 1)
    vl = prefill_visible(s, 1)
    sc, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True, block=block)
    ref_sc, ref_bm = K.index_scores_ref(q, codes, scales, w, vl, n=n, block_max=True, block=block)
    assert bm.shape[-1] == -(-n // block) and same(sc, ref_sc) and same(bm, ref_bm), f"seed={seed}"
    keep = K.candidate_blocks(bm, vl, topk_blocks=kb, block=block)
    assert same(keep, K.candidate_blocks_ref(bm, vl, topk_blocks=kb, block=block)), f"seed={seed}"
    funnel = type("Funnel", (), {"block_size": block, "topk_blocks": kb})()
    eager = Indexer.candidate_mask(funnel, ref_sc.float(), vl.long())
    assert same(K.expand_blocks(keep, n, block), eager), f"seed={seed}"
    sc2, _ = K.index_scores(q2, codes, scales, w2, vl, keep, n=n, block=block)
    ref_sc2, _ = K.index_scores_ref(q2, codes, scales, w2, vl, keep, n=n, block=block)
    assert same(sc2, ref_sc2), f"seed={seed}"
    got = K.index_topk(sc2, vl, keep, k=k, offset=s, block=block)
    assert same(got, K.index_topk_ref(ref_sc2, vl, k=k, offset=s)), f"seed={seed}"


def test_cuda_builds_refuse_other_block_sizes():
    """Without a GPU: the CUDA scoring with candidate flags or block maxima, and the candidate-mode
    select, are written for blocks of 8 and say so; the funnel's select takes any size (only its
    pinned block depends on it), and scores without either ignore it."""
    with pytest.raises(ValueError, match="CUDA build takes candidate blocks of 8 entries, got 4"):
        K.scores_prim_func(32, 128, False, True, False, "cuda", 4)
    with pytest.raises(ValueError, match="CUDA build takes candidate blocks of 8 entries, got 4"):
        K.scores_prim_func(32, 128, False, False, True, "cuda", 4)
    with pytest.raises(ValueError, match="candidate mode takes blocks of 8 entries, got 4"):
        K.select_prim_func("cand", "emit", "cuda", 4)
    K.select_prim_func("blocks", "emit", "cuda", 4)
    K.scores_prim_func(32, 128, False, False, False, "cuda", 4)


def test_one_build_serves_all_shapes_cpu():
    before = K.build.cache_info().currsize
    for b, s, n in ((1, 1, 9), (2, 3, 17), (3, 2, 64)):
        q, codes, scales, w = make_inputs(b, s, H, D, n, fresh_seed())
        sc, _ = K.index_scores(q, codes, scales, w, n=n)
        K.index_topk(sc, torch.full((s,), n, dtype=torch.int32), k=min(4, n), offset=0)
    assert K.build.cache_info().currsize - before <= 2


def test_bad_inputs_raise():
    q, codes, scales, w = make_inputs(1, 2, H, D, 8, 0)
    with pytest.raises(ValueError, match="q must be"):
        K.index_scores(q.float(), codes, scales, w, n=8)
    with pytest.raises(ValueError, match="n=12"):
        K.index_scores(q, codes, scales, w, n=12)
    with pytest.raises(ValueError, match="visible_len"):
        K.index_scores(q, codes, scales, w, torch.zeros(3, dtype=torch.int32), n=8)
    with pytest.raises(ValueError, match="k=-1"):
        K.index_topk(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), k=-1, offset=0)
    for bad in (torch.ones(1, 2, 2, dtype=torch.bool), torch.ones(1, 2, 3, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="cand_blocks must be bool"):
            K.index_topk(torch.zeros(1, 2, 20, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), bad,
                         k=1, offset=0)


@pytest.mark.parametrize("k", [5, 8, 13])
def test_topk_wider_than_the_scores_is_padded_like_the_model(k):
    """k >= n (a decode step before the context has K_I compressed rows): every visible entry, then
    -1, as the model's top-k over -inf-padded scores gives (`pad_to`); the ref does the same."""
    n, offset = 5, 7
    sc = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(fresh_seed())).bfloat16()
    vl = torch.tensor([0, 3, 5], dtype=torch.int32)
    got = K.index_topk(sc, vl, k=k, offset=offset)
    assert same(got, K.index_topk_ref(sc, vl, k=k, offset=offset))
    want = [[v + offset if v < min(vis, n) else -1 for v in range(k)] for vis in vl.tolist()]
    assert got.tolist() == [want, want]


def opcheck_all(device):
    b, s, n = 2, 5, 21
    q, codes, scales, w = make_inputs(b, s, 8 if device == "cuda" else H, D, n, fresh_seed(), device=device)
    vl = prefill_visible(s, 1, device) + 16
    cand = torch.rand(b, s, 3, device=device) < 0.5
    torch.library.opcheck(torch.ops.dsv41c.index_scores, (q, codes, scales, w, vl, cand),
                          {"n": n, "block_max": True}, test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.dsv41c.index_scores, (q, codes, scales, w, None, None),
                          {"n": n, "block_max": False}, test_utils=OPCHECK)
    sc, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True)
    torch.library.opcheck(torch.ops.dsv41c.index_topk, (sc, vl), {"k": 7, "offset": 3}, test_utils=OPCHECK)
    sc2, _ = K.index_scores(q, codes, scales, w, vl, cand, n=n)
    torch.library.opcheck(torch.ops.dsv41c.index_topk, (sc2, vl, cand), {"k": 7, "offset": 3}, test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.dsv41c.candidate_blocks, (bm, vl), {"topk_blocks": 2}, test_utils=OPCHECK)
    # candidate blocks of 4 entries (6 of them for 21 keys)
    cand4 = torch.rand(b, s, 6, device=device) < 0.5
    if device != "cuda":  # (the CUDA scoring takes blocks of 8 only)
        torch.library.opcheck(torch.ops.dsv41c.index_scores, (q, codes, scales, w, vl, cand4),
                              {"n": n, "block_max": True, "block": 4}, test_utils=OPCHECK)
        _, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True, block=4)
    else:
        bm = bm.repeat_interleave(2, dim=-1)[..., :6]
    torch.library.opcheck(torch.ops.dsv41c.index_topk, (sc, vl, cand4), {"k": 7, "offset": 3, "block": 4},
                          test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.dsv41c.candidate_blocks, (bm, vl), {"topk_blocks": 2, "block": 4},
                          test_utils=OPCHECK)


def test_opcheck_cpu():
    opcheck_all("cpu")


# ----------------------------------------------------------------------------------- CUDA

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
def test_cuda_scores_build_compiles_for_sm90a():
    """Without a GPU: the sm_90a scoring build (all options) compiles with nvcc; it reads the packed
    keys with 16-byte loads, decodes them with bf16x2 multiplies, runs wgmma, and takes the block
    max by lane shuffles.  (One build only, ~20 s: the select phases compile the same way.)"""
    src = K.build("scores", (32, 128, True, True, True), "cuda:sm_90a").get_kernel_source()
    assert "wgmma" in src and "__shfl_xor_sync" in src and "*(uint4*)(CODES" in src
    assert "dsv41c_decode_block" in src and "mul.rn.bf16x2" in src


def _bf16_mul(a, b):
    """bf16 bits a * b rounded to nearest even (the product of two bf16 is exact in fp32)."""
    f = (a.int() << 16).view(torch.float32) * (b.int() << 16).view(torch.float32)
    return f.bfloat16().view(torch.int16).int() & 0xFFFF


def test_cuda_decode_formula_cpu():
    """The CUDA build's key decode (`_DECODE_PRELUDE`, replayed here bit for bit) of every code
    byte at every scale byte equals the ref's dequantised bf16 keys, in the column order `_qperm`
    gives the queries; so does its one-multiply path at every scale byte it takes (0..128)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(256, 1, 256)  # [scale byte, 1, 16 blocks]
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1, 1).expand(256, 1, 16).contiguous()
    ref = quant.mxfp4_dequant_ref(codes, scales, torch.bfloat16).view(256, 16, 32)
    s = torch.arange(256).view(256, 1, 1)
    sb = torch.where(s == 0, 0x40, torch.where(s == 255, 0x7FC0, s << 7))
    words = codes.view(256, 16, 4, 4).long()
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [scale, block, q]
    f = (s.clamp(max=128) + 126) << 7  # the one-multiply path (a warp whose s are all <= 128): x 2^(s-1)
    s6 = (words << 6) & 0xFFFFFFFF  # dsv41c_e2m1_words(w, x), on int64
    v01 = (words & ~0x22002200) | (s6 & 0x22002200)
    v23 = ((words & ~0x00220000) | (s6 & 0x00220000)) | (words >> 26) << 32  # hi:v23 for the funnel
    xs = [(v01 << 6) & 0x81C081C0, (v01 << 2) & 0x81C081C0, (v23 >> 2) & 0x81C081C0, (v23 >> 6) & 0x81C081C0]
    got, got_one = [], []
    for x in xs:  # each x[i], its two halves, then the multiplies
        got.append([_bf16_mul(_bf16_mul((x >> h) & 0xFFFF, torch.tensor(0x7E80)), sb) for h in (0, 16)])
        got_one.append([_bf16_mul((x >> h) & 0xFFFF, f) for h in (0, 16)])
    got, got_one = (torch.stack([torch.stack(p, dim=-1) for p in g], dim=-2).flatten(-3)  # [scale, block, 32]
                    for g in (got, got_one))
    want = ref[..., [K._qperm(c) for c in range(32)]].view(torch.int16).int() & 0xFFFF
    nan = ref[..., [K._qperm(c) for c in range(32)]].isnan()
    assert torch.equal(got.to(torch.int16).view(torch.bfloat16).isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert not nan[:129].any() and torch.equal(got_one[:129], want[:129])  # s = 0 .. 128


def test_register_fragment_column_order():
    """`_qperm_regs` is a permutation of the 128 dims, and for every thread and row of the wgmma
    A fragment (`_frag_a`, the layout the scoring annotates), the element that `dsv41c_decode_frag`
    writes with word r, half e of its scale block's decode (dims 8 (r // 4) + r % 4 + 4 e, replayed
    here) sits in a column whose query dim `_qperm_regs` gives as that same key dim."""
    assert sorted(K._qperm_regs(c) for c in range(128)) == list(range(128))
    at = {K._frag_a(i, c): c for i in range(64) for c in range(128)}  # (thread, element) -> column
    assert len(at) == 64 * 128
    for thread in range(128):
        block = thread % 32 % 4  # the scale block a thread decodes (its lane % 4)
        for h in range(2):  # its two rows of the m64 tile
            for r in range(16):
                for e in range(2):
                    element = ((r // 2) * 4 + (r % 2) * 2 + h) * 2 + e  # dsv41c_decode_frag's word, half
                    c = at[thread, element]
                    assert K._qperm_regs(c) == 32 * block + 8 * (r // 4) + r % 4 + 4 * e, (thread, h, r, e)


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on int64 tensors of 32-bit values: byte i of the result is byte
    (nibble i of sel) & 7 of {b, a}, or that byte's sign bit replicated where the nibble's bit 3 is set."""
    src, sel = a | b << 32, torch.as_tensor(sel)
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> 4 * i) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        byte = torch.where(nib & 8 != 0, torch.where(byte & 0x80 != 0, 0xFF, 0), byte)
        out |= byte << 8 * i
    return out


def test_fp8_decode_formula_cpu():
    """`dsv41c_decode_frag8` (replayed bit for bit) turns every code byte, at every scale offset j =
    0..11 it is used with, into the E4M3 bytes of E2M1 x 2^(j - 5) (exact: torch's own E4M3
    conversion of the ref's values), in the column order `_qperm8` gives the queries; and the
    fragment words it writes are where the hardware layout `_frag_a8` (which TileLang checks against
    its wgmma operand) puts those columns."""
    words = torch.randint(0, 2 ** 32, (4096,), dtype=torch.int64)
    words[:256] = torch.arange(256) * 0x01010101  # every code byte
    elems = torch.stack([(words >> 4 * e) & 0xF for e in range(8)], -1)  # nibble e: element e
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    for j in range(12):
        lo, hi = 0x14100800 + j * 0x08080800, 0x24201C18 + j * 0x08080808
        m, w4 = words & 0x77777777, (words << 4) & 0xFFFFFFFF
        o0 = (_prmt(w4, words, 0x5140) & 0x80808080) | _prmt(torch.full_like(m, lo), torch.full_like(m, hi), m)
        o1 = (_prmt(w4, words, 0x7362) & 0x80808080) | _prmt(torch.full_like(m, lo), torch.full_like(m, hi), m >> 16)
        got = torch.stack([(o >> 8 * i) & 0xFF for o in (o0, o1) for i in range(4)], -1)  # bytes: nibbles 0..7
        want = (e2m1[elems] * 2.0 ** (j - 5)).to(torch.float8_e4m3fn).view(torch.uint8).long()
        assert torch.equal(got, want), j
    assert sorted(K._qperm8(c) for c in range(128)) == list(range(128))
    at = {K._frag_a8(i, c): c for i in range(64) for c in range(128)}  # (thread, byte) -> column
    assert len(at) == 64 * 128
    for thread in range(128):
        block = thread % 4
        for h in range(2):
            for q in range(4):  # code word q: output words o0, o1 at fragment words 4q + h, 4q + 2 + h
                for f in range(2):
                    for i in range(4):
                        c = at[thread, (4 * q + 2 * f + h) * 4 + i]
                        assert K._qperm8(c) == 32 * block + 8 * q + 4 * f + i, (thread, h, q, f, i)


def _fp8_head_replay(q, w):
    """`dsv41c_fp8_head` and the E4M3 query test replayed for one query (q [H, d], w [H] bf16):
    (m [H], whether the CTA takes the bf16 path, the window [lo, hi] of a key's least scale byte)."""
    qb, wb = (t.view(torch.int16).int() & 0xFFFF for t in (q, w))
    mx = ((qb >> 7) & 0xFF).amax(dim=-1)
    m = torch.where(mx == 0, 0, mx - 135)
    wf = (wb >> 7) & 0xFF
    ew, wnz = wf - 127, (wb & 0x7FFF) != 0
    bad = (m < -117) | (wnz & ((wf == 0) | (m + ew < -103) | (m + ew > 95)))
    m = torch.where(bad, 0, m)
    lo = torch.where(wnz, torch.maximum(-110 - m, -103 - m - ew), -110 - m) + 122
    hi = torch.where(wnz, torch.minimum(101 - m, 95 - m - ew), 101 - m) + 122
    qs = q.float() * torch.exp2(-m.float())[:, None]
    exact = (qs.to(torch.float8_e4m3fn).float() == qs) & ~((qs == 0) & (q.float() != 0))
    return m, bool(bad.any() or not exact.all()), max(2, int(lo.max())), min(249, int(hi.min()))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 31 - 1), st.integers(-40, 40), st.integers(-40, 30))
def test_fp8_scaling_exact_inside_the_window_cpu(seed, qe, we):
    """The E4M3 scoring's argument (`_FP8_KEYS`), on torch's own ops: dividing head h's query by
    2^m_h, each key by 2^(min_s - 122) (its blocks then E2M1 x 2^(s - min_s - 5), which E4M3 holds),
    and multiplying w by 2^m_h gives the ref's scores times 2^-(min_s - 122) exactly, bit for bit,
    for every key whose least scale byte lies in the window `dsv41c_fp8_head` allows (replayed) and
    whose scale bytes are at most 252 (above, the ref's bf16 key is inf: the kernel tests both).
    Keys are swept across the window and past both ends, with block spreads up to 11; queries and
    w are scaled by 2^qe and 2^we so that the window moves and its edges reach tiny and huge
    products."""
    g = torch.Generator().manual_seed(seed)
    h, d = 32, 128
    q = quant.fp4_ue8m0_fake_quant((torch.randn(h, d, generator=g) * 2.0 ** qe).bfloat16(), 32)
    w = (torch.randn(h, generator=g) * 2.0 ** we).bfloat16()
    w[3] = 0
    m, bad, lo, hi = _fp8_head_replay(q, w)
    assert not bad and lo <= hi, (m, lo, hi)
    mns = torch.arange(max(0, lo - 4), min(243, hi + 4) + 1)
    n = len(mns) * 4
    mn = mns.repeat_interleave(4)
    spread = torch.randint(0, 12, (n, 4), generator=g)
    spread[:, 0] = 0  # block 0 holds the least scale
    scales = (mn[:, None] + spread).clamp(max=254).to(torch.uint8)
    codes = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
    ref, _ = K.index_scores_ref(q[None, None], codes[None], scales[None], w[None, None])
    wq = (w.float() * torch.exp2(m.float())).bfloat16()
    assert torch.equal(wq.float(), w.float() * torch.exp2(m.float()))  # w' exact
    qq = (q.float() * torch.exp2(-m.float())[:, None]).bfloat16()  # the E4M3 query (exact: `bad` is False)
    kq = (scales.int() - mn[:, None] + 122).to(torch.uint8)  # blocks at E2M1 x 2^(s - min_s - 5)
    emu, _ = K.index_scores_ref(qq[None, None], codes[None], kq[None], wq[None, None])
    emu = emu.float() * torch.exp2(mn.float() - 122)
    inside = (mn >= lo) & (mn <= hi) & (scales.amax(dim=1) <= 252)  # the kernel's per-key test
    assert inside.any()
    assert torch.equal(emu[0, 0, inside], ref.float()[0, 0, inside]), (seed, qe, we, lo, hi)


def ulp_close(got, ref, seed):
    """Same -inf pattern; finite scores within one bf16 rounding step of the largest, and
    nearly all bit-equal (the tensor cores and torch sum in other orders)."""
    inf = ref == float("-inf")
    assert torch.equal(got == float("-inf"), inf), f"seed={seed}: -inf pattern"
    g, r = got.float()[~inf], ref.float()[~inf]
    assert not g.isnan().any(), f"seed={seed}: NaN"
    if r.numel():
        err = ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        assert err <= 2 ** -8, f"seed={seed}: {err}"
        assert (g == r).float().mean() >= 0.99, f"seed={seed}: {(g == r).float().mean()}"


def block_max_of(sc):
    n = sc.shape[-1]
    nb = -(-n // K.BLOCK)
    pad = torch.nn.functional.pad(sc.float(), (0, nb * K.BLOCK - n), value=float("-inf"))
    return pad.unflatten(-1, (nb, K.BLOCK)).amax(dim=-1).to(sc.dtype)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kept", (None, 0.25, 0.02, 1.0), ids=["all", "cand", "sparse", "allkept"])
@pytest.mark.parametrize("b,n", ((1, 8269), (32, 8269), (1, 100003)))
def test_cuda_scores_released_dims_decode(b, n, kept):
    """32 heads x 128, one query per sequence, keys a strided view of a larger cache; n is no multiple of the
    128-key tile, and batch 32 / 100K keys make each CTA walk several tiles.  With candidate blocks
    (a fraction `kept` of them, the last, partial block among them) each CTA gathers its kept
    blocks into tiles: a range without any, a few, or all of them (as many tiles as without)."""
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(b, 1, 32, 128, n, seed, rows=n + 100, device="cuda")
    # the keys as a cache read: a strided view of a larger buffer (passed uncopied)
    codes_v, scales_v = cache_read(codes, n + 300, b + 1), cache_read(scales, n + 300, b + 1)
    cand = None
    if kept is not None:
        cand = torch.rand(b, 1, -(-n // 8), device="cuda") < kept
        if kept < 1:
            cand[..., 300:700] = False  # whole key ranges without a kept block
        cand[..., -1] = True
    sc, bm = K.index_scores(q, codes_v, scales_v, w, None, cand, n=n, block_max=True)
    ref, _ = K.index_scores_ref(*(t.cpu() for t in (q, codes, scales, w)), None,
                                None if cand is None else cand.cpu(), n=n)
    ulp_close(sc.cpu(), ref, seed)
    assert same(bm, block_max_of(sc)), f"seed={seed}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fq", (True, False), ids=["mxfp4_q", "bf16_q"])
@pytest.mark.parametrize("b,s,ratio", ((2, 300, 1), (1, 1030, 4)))
def test_cuda_scores_prefill(fq, b, s, ratio):
    """Causal prefill: every query's visible edge, inside and across the key tiles."""
    seed, n = fresh_seed(), s // ratio
    q, codes, scales, w = make_inputs(b, s, 32, 128, n, seed, fq=fq, device="cuda")
    vl = prefill_visible(s, ratio, "cuda")
    cand = torch.rand(b, s, -(-n // 8), device="cuda") < 0.5
    for c in (None, cand):
        sc, bm = K.index_scores(q, codes, scales, w, vl, c, n=n, block_max=True)
        ref, _ = K.index_scores_ref(*(t.cpu() for t in (q, codes, scales, w, vl)), None if c is None else c.cpu(), n=n)
        ulp_close(sc.cpu(), ref, seed)
        assert same(bm, block_max_of(sc)), f"seed={seed}"


def _sm90_scores_source(cand=False):
    """CUDA source of the sm_90a scoring build (decode options), lowered without nvcc."""
    import tilelang

    from dsv41c.tilelang_kernels.quant import cuda_pass_configs
    main = K.scores_prim_func(32, 128, False, cand, True, "cuda")
    tgt = {"kind": "cuda", "arch": "sm_90a"}
    with tilelang.tvm.transform.PassContext(config=cuda_pass_configs(main)), tilelang.tvm.target.Target(tgt):
        return tilelang.lower(main, target=tgt).kernel_source


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("sets", ({"_BN": 256, "_THREADS": 256, "_CTAS_PER_SM": 2},
                                  {"_BN": 256, "_THREADS": 256, "_CTAS_PER_SM": 3},
                                  {"_KEYS_IN_REGS": 0}, {"_HEAD_SUM_MMA": 0}, {"_UNGUARDED": 0},
                                  {"_FP8_KEYS": 0}),
                         ids=["2x256", "3x256", "shared_key_tile", "head_sum_by_adds", "guarded", "bf16_keys"])
def test_cuda_scores_variants(sets, monkeypatch):
    """The scoring's timed build choices other than the defaults (5 CTAs of 128 keys on one
    warpgroup, keys in registers, the head sum on the tensor cores, no TileLang guards, E4M3 keys
    where exact) against the ref: 256 keys on two warpgroups at 2 or 3 CTAs per SM, the shared key
    tile (which indexes each unit, not through running addresses), the head sum by adds, TileLang's
    guards, bf16 keys throughout (through running addresses); decode with and without candidates,
    and a causal prefill."""
    for name, value in sets.items():
        monkeypatch.setattr(K, name, value)
    K.build.cache_clear()  # builds are cached per op key, which does not name these switches
    try:
        test_cuda_scores_released_dims_decode(1, 100003, 0.25)
        test_cuda_scores_released_dims_decode(32, 8269, None)
        test_cuda_scores_prefill(True, 1, 1030, 4)
    finally:
        K.build.cache_clear()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", (16, 32, 64))
def test_cuda_scores_fp8_keys_fallbacks(h, monkeypatch):
    """The E4M3 keys' GEMM (`_FP8_KEYS`) where it is exact and the bf16 path where it is not, in one
    call: batch rows with MXFP4 queries and rows with plain bf16 ones (not E4M3 after any power of
    two); keys whose scale blocks span more than 11 binades; a head with w = 0, one with a tiny w
    (its row on the bf16 path); and keys with every block scaled by 2^100 or 2^-100, in and out of
    the window the queries allow.  The odd keys are 1 in 2000 each, so that most CTAs walk some
    tiles on the E4M3 path and then switch to the bf16 path midway.  (With candidate blocks the
    bf16 build runs.)"""
    monkeypatch.setattr(K, "_FP8_KEYS", 1)
    K.build.cache_clear()
    try:
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        b, n = 4, 100003  # 5 tiles a CTA (`cuda_tiles_per_cta`)
        q, codes, scales, w = make_inputs(b, 1, h, 128, n, seed)
        q[1] = (torch.randn(1, h, 128, generator=g) * 3).bfloat16()  # not MXFP4
        w[2, 0, 0] = 0
        w[2, 0, 1] = 2.0 ** -100
        wide = torch.rand(b, n + 3, generator=g) < 0.0005
        scales[..., 3] = torch.where(wide, (scales[..., 3].int() + 14).clamp(max=254).to(torch.uint8), scales[..., 3])
        edge = torch.rand(b, n + 3, generator=g) < 0.0005  # all of a key's blocks far up or down
        shift = torch.where(torch.rand(b, n + 3, 1, generator=g) < 0.5, -100, 100)
        scales = torch.where(edge[..., None], (scales.int() + shift).clamp(1, 254).to(torch.uint8), scales)
        cand = torch.rand(b, 1, -(-n // 8), generator=g) < 0.5
        for c in (None, cand):
            got, bm = K.index_scores(*(t.cuda() for t in (q, codes, scales, w)), None,
                                     None if c is None else c.cuda(), n=n, block_max=True)
            ref, _ = K.index_scores_ref(q, codes, scales, w, None, c, n=n)
            ulp_close(got.cpu(), ref, seed)
            assert same(bm, block_max_of(got)), f"seed={seed}"
    finally:
        K.build.cache_clear()


@pytest.mark.gpu
@cuda
def test_cuda_scores_fp8_path_taken(monkeypatch):
    """The E4M3 path really runs, and the switch to the bf16 path really happens: with the bf16
    path poisoned (`_FP8_POISON_BF16_PATH`: NaN products), MXFP4 queries against ordinary keys
    score right everywhere (every tile took the E4M3 path), a batch row with a plain bf16 query
    scores NaN everywhere (its CTAs switched before their first tile), and a key whose blocks span
    more than 11 binades turns its tile and the rest of its CTA's walk to NaN."""
    monkeypatch.setattr(K, "_FP8_KEYS", 1)
    monkeypatch.setattr(K, "_FP8_POISON_BF16_PATH", 1)
    K.build.cache_clear()
    try:
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        b, n = 3, 100003
        q, codes, scales, w = make_inputs(b, 1, 32, 128, n, seed)
        q[1] = (torch.randn(1, 32, 128, generator=g) * 3).bfloat16()  # not MXFP4
        tpc = K.cuda_tiles_per_cta(n, b)
        wide = tpc * K._BN * 2 + 5  # a key in row 2's third CTA, its first tile
        scales[2, wide, 3] = min(int(scales[2, wide, 0]) + 14, 254)
        got, _ = K.index_scores(*(t.cuda() for t in (q, codes, scales, w)), n=n, block_max=True)
        got = got.cpu()
        ref, _ = K.index_scores_ref(q, codes, scales, w, n=n)
        ulp_close(got[0:1], ref[0:1], seed)  # row 0: all E4M3
        assert got[1].isnan().all(), f"seed={seed}"
        cta = slice(tpc * K._BN * 2, tpc * K._BN * 3)  # row 2's third CTA: NaN from the wide key's tile on
        assert got[2, 0, cta].isnan().all(), f"seed={seed}"
        rest = torch.ones(n, dtype=torch.bool)
        rest[cta] = False
        ulp_close(got[2:3, :, rest], ref[2:3, :, rest], seed)
    finally:
        K.build.cache_clear()


def test_cuda_scores_fp8_keys_lower_for_sm90(monkeypatch):
    """Without a GPU: with `_FP8_KEYS` the build holds both GEMMs, the E4M3 one as k32 wgmma on a
    register A operand (whose layout, `_frag_a8`, TileLang checks against its own), the per-head
    setup and the tile's vote (the candidate-gathering build excepted); without it, none of them."""
    monkeypatch.setattr(K, "_FP8_KEYS", 1)
    src = _sm90_scores_source()
    assert "tl::wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 32, 32" in src
    assert "tl::wgmma_rs<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 32, 16" in src
    assert "dsv41c_decode_frag8((" in src and "dsv41c_fp8_head(mx" in src and "__any_sync" in src
    # its bf16 path in two GEMMs of k 64, each after its half of the decode
    assert src.count("dsv41c_decode_frag_half((") == 2 and "dsv41c_decode_frag((" not in src
    # the per-tile barriers of the bf16 build (below), and three once per CTA: the setup's shared
    # words set, the heads' powers of two and window, the E4M3 query tile written
    assert src.count("__syncthreads();") == 4 and src.count("__syncthreads_or(") == 1
    assert "kFloat8_e4m3" not in _sm90_scores_source(cand=True)  # the candidate-gathering build: bf16
    assert "quiet_NaN" not in src.split("main_kernel")[-1]
    monkeypatch.setattr(K, "_FP8_POISON_BF16_PATH", 1)  # (test_cuda_scores_fp8_path_taken's build)
    assert "quiet_NaN" in _sm90_scores_source().split("main_kernel")[-1]
    monkeypatch.setattr(K, "_FP8_POISON_BF16_PATH", 0)
    monkeypatch.setattr(K, "_FP8_KEYS", 0)
    src = _sm90_scores_source()
    assert "kFloat8_e4m3" not in src and "dsv41c_fp8_head(mx" not in src and "dsv41c_decode_frag8((" not in src


def test_cuda_scores_running_addrs_lower_for_sm90(monkeypatch):
    """Without a GPU: the dense builds, E4M3 and bf16, take each pass's key bytes from the walk's
    running addresses and store the scores and block maxima through two more (set once from the
    CTA's range, stepped a tile each trip); the candidate-gathering build keeps its own indexing."""
    for fp8 in (1, 0):
        monkeypatch.setattr(K, "_FP8_KEYS", fp8)
        body = _sm90_scores_source().split("main_kernel")[-1]
        assert body.count("dsv41c_addr(") == 4 and body.count("kp[0] = (kp[0] + (uint64_t)8192);") == 2
        assert body.count("kp[2] = (kp[2] + (uint64_t)256);") == 1 and body.count("kp[3] = (kp[3] + (uint64_t)32);") == 1
        assert "dsv41c_load_pass(kp[0], kp[1]" in body and body.count("dsv41c_st_bf16(kp[") == 2
        for buf in ("CODES", "SCALES", "SC", "BM"):  # no other indexing of them
            assert f"{buf}[" not in body.replace(f"dsv41c_addr((&({buf}[", ""), buf
    body = _sm90_scores_source(cand=True).split("main_kernel")[-1]
    assert "dsv41c_load_pass(" not in body and "dsv41c_addr(" not in body and "dsv41c_st_bf16(" not in body
    monkeypatch.setattr(K, "_UNGUARDED", 0)  # nor does the guarded build (no address of a guarded element)
    assert "dsv41c_load_pass(" not in _sm90_scores_source().split("main_kernel")[-1]


def test_cuda_scores_lower_for_sm90(monkeypatch):
    """Without a GPU: the decode build with bf16 keys lowers with the warp vote for the one-multiply
    decode, the epilogue's relu and weight product on bf16 pairs summed over heads by a second
    wgmma (register A operand), and launch bounds for `_CTAS_PER_SM` CTAs."""
    monkeypatch.setattr(K, "_FP8_KEYS", 0)
    src = _sm90_scores_source()
    assert "dsv41c_decode_block" in src and "__all_sync(0xffffffffu, s <= 128u)" in src
    assert "tl::mul2(" in src and "tl::max2(" in src
    assert K._HEAD_SUM_MMA and "tl::wgmma_rs<" in src and "AllReduce" not in src
    assert f"__launch_bounds__({K._THREADS}, {K._CTAS_PER_SM})" in src  # the tile plan's CTAs per SM
    # the keys decoded straight into the first wgmma's register A fragment, in two m64 passes
    assert K._KEYS_IN_REGS and src.count("dsv41c_decode_frag(") == 2 and "dsv41c_decode_block(" not in src.split("main_kernel")[-1]
    # the kernel's own barriers, two per tile and no others: the vote for live keys (the previous
    # tile's readers of Rs are done) and Rs written (TileLang's barrier pass is off for it)
    assert src.count("__syncthreads();") == 1 and src.count("__syncthreads_or(") == 1


def test_cuda_scores_head_sum_by_adds_with_two_warpgroups(monkeypatch):
    """Without a GPU: 256-key tiles on two warpgroups, where TileLang cannot lay the second
    wgmma's register operand out like the first's accumulator, sum over heads by adds and lane
    shuffles instead (and so does `_HEAD_SUM_MMA=0`)."""
    for name, value in (("_BN", 256), ("_THREADS", 256), ("_CTAS_PER_SM", 2)):
        monkeypatch.setattr(K, name, value)
    src = _sm90_scores_source()
    assert "tl::wgmma_rs<" not in src and "AllReduce" in src
    assert "dsv41c_decode_block(" in src.split("main_kernel")[-1]  # and the shared key tile
    monkeypatch.setattr(K, "_HEAD_SUM_MMA", 0)
    monkeypatch.setattr(K, "_BN", 128)
    monkeypatch.setattr(K, "_THREADS", 128)
    src = _sm90_scores_source()
    assert src.count("tl::wgmma_rs<") == 1 and "AllReduce" in src  # the keys' GEMM only
    monkeypatch.setattr(K, "_KEYS_IN_REGS", 0)
    src = _sm90_scores_source()
    assert "tl::wgmma_rs<" not in src and "AllReduce" in src


def test_cuda_scores_unguarded_build_lowers(monkeypatch):
    """Without a GPU: `_UNGUARDED` drops TileLang's own bounds guards (a second test of each key
    row against the cache rows NC) from the scoring's loads; the kernel's guards (t < lim) stay."""
    monkeypatch.setattr(K, "_UNGUARDED", 0)
    assert "< NC)" in _sm90_scores_source()
    monkeypatch.setattr(K, "_UNGUARDED", 1)
    for cand in (False, True):
        src = _sm90_scores_source(cand).split("main_kernel")[-1]
        assert "< NC)" not in src and "< lim)" in src


def test_cuda_scores_gather_lowers_for_sm90():
    """Without a GPU: with candidate blocks each CTA compacts its range's kept blocks (a warp
    ballot, one shared atomic per warp) behind two more barriers, then walks the gathered tiles."""
    src = _sm90_scores_source(cand=True)
    assert "__ballot_sync" in src and src.count("AtomicAddRet(") == 1
    assert src.count("__syncthreads();") == 3 and src.count("__syncthreads_or(") == 1
    assert "it < walk" in src  # the tile loop's trip count is the compacted count
    # the blocks not kept get their -inf scores by one 16-byte store a block where aligned
    assert src.count("dsv41c_fill_neg_inf8(") == 2 and "*reinterpret_cast<uint4*>(p) = make_uint4(0xFF80FF80u" in src


def test_cuda_select_candidates_lower_for_sm90():
    """Without a GPU: the candidate-mode select builds a list of the kept blocks per window (a block
    scan of 8 flags a thread) and places its own barriers: a count pass has, per window, the scan's
    two and one after the list, none per step; the emit adds the scan's two per step."""
    import tilelang

    from dsv41c.tilelang_kernels.quant import cuda_pass_configs
    tgt = {"kind": "cuda", "arch": "sm_90a"}
    src = {}
    for phase in K.SELECT_PHASES:
        main = K.select_prim_func("cand", phase, "cuda")
        with tilelang.tvm.transform.PassContext(config=cuda_pass_configs(main)), tilelang.tvm.target.Target(tgt):
            src[phase] = tilelang.lower(main, target=tgt).kernel_source
    for phase in SELECT_PHASES_BARRIERS:
        assert src[phase].count("__syncthreads();") == SELECT_PHASES_BARRIERS[phase], phase
        # the split's CTAs per SM fit the register budget (the emit took 83 registers without it: 3 CTAs)
        assert f"__launch_bounds__({K._SEL_THREADS}, {K._SEL_CTAS_PER_SM})" in src[phase]
        assert "const uchar* __restrict__ CAND" in src[phase] and "((int*)LS)[" in src[phase]


# barriers in the source, per phase: hist0 = the zeroed bins, one list (3) and the end; hist1 =
# find_bin (3), the zeroed bins, one list (3), two block scans for the part's counts (4); emit = two
# find_bins (6), the earlier parts' counts (a loop over one scan: 2), one list (3), the step's scan (2)
SELECT_PHASES_BARRIERS = {"hist0": 5, "hist1": 11, "emit": 13}


def test_benchmark_ablations_replace_only_the_decode(monkeypatch):
    """benchmarks/indexer.py --ablate (how the decode's share of the scoring was timed) swaps the body
    of `dsv41c_decode16` and nothing else of the prelude, in the bf16 keys' build (whose decode it
    is), and the scoring still lowers with it."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "indexer", raising=False)
    import indexer as BI
    src = K._DECODE_PRELUDE
    head = src[:src.index("{", src.index("void dsv41c_decode16(")) + 1]
    tail = src[src.index("\n}\n", len(head)) + 3:]
    monkeypatch.setattr(K, "_FP8_KEYS", 1)  # restored after the test; ablate() clears it
    for part, body in BI._ABLATIONS.items():
        monkeypatch.setattr(K, "_DECODE_PRELUDE", src)
        BI.ablate(part)
        assert K._DECODE_PRELUDE == head + body + tail, part
    assert K._FP8_KEYS == 0
    src = _sm90_scores_source()
    assert "0x3F803F80u" in src.split("main_kernel")[0]  # the last one, noload, lowered
    assert "dsv41c_decode_frag((" in src and "kFloat8_e4m3" not in src  # into the bf16 build


def test_sass_tool_counts_the_longest_loop(monkeypatch):
    """benchmarks/sass.py's "loop" column (how the scoring variants were counted): the instructions
    from a backward branch's target to the branch, the widest such span; a forward branch is none."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "sass", raising=False)
    import sass
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
.L_x_2:
        /*0030*/                   NOP ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   BRA `(.L_x_2) ;
        /*0060*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0070*/                   EXIT ;
"""
    assert sass.longest_loop(text) == 4 and sass.longest_loop(text.replace("(.L_x_1)", "(.L_x_3)")) == 3
    assert sass.opcode_counts(text)["BRA"] == 3
    # an out-of-line retry path after the last EXIT jumps back into the code it left: no loop
    retry = text + """.L_x_4:
        /*0080*/                   NOP ;
        /*0090*/              @!P0 BRA `(.L_x_4) ;
        /*00a0*/                   BRA `(.L_x_1) ;
"""
    assert sass.longest_loop(retry) == 4


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k", ((8192, 512), (3000, 3000), (70000, 512), (8195, 512), (100, 1)))
def test_cuda_topk_bit_exact(n, k):
    seed, s = fresh_seed(), 5
    vl = torch.tensor([n, n - 3, n // 2, 1, 0], dtype=torch.int32)
    for masked in (0.0, 0.95):
        sc = random_scores(4, s, n, seed, vl, masked)
        got = K.index_topk(sc.cuda(), vl.cuda(), k=k, offset=128)
        assert same(got.cpu(), K.index_topk_ref(sc, vl, k=k, offset=128)), f"seed={seed} masked={masked}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("k", (512, 2048))
def test_cuda_topk_long_row(k):
    """One query over 256K scores: the row is split over many CTAs."""
    seed, n = fresh_seed(), 262144
    vl = torch.tensor([n - 5], dtype=torch.int32)
    for masked in (0.0, 0.999):
        sc = random_scores(1, 1, n, seed, vl, masked)
        got = K.index_topk(sc.cuda(), vl.cuda(), k=k, offset=128)
        assert same(got.cpu(), K.index_topk_ref(sc, vl, k=k, offset=128)), f"seed={seed} masked={masked}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b,s,n,k,frac", ((4, 5, 8192, 512, 0.06), (4, 5, 8195, 512, 0.06), (1, 1, 262144, 512, 0.0625),
                                          (2, 3, 70000, 2048, 0.5), (40, 15, 20000, 64, 0.3), (2, 3, 3001, 1, 0.01)),
                         ids=["8K", "8K+3", "256K", "70K_half", "600rows", "k1"])
def test_cuda_topk_candidates(b, s, n, k, frac, monkeypatch):
    """The top-k given the candidate flags reads only the kept blocks (lists per window of 2048
    blocks; 600 rows make one part a row, 2-3 windows); every row has -inf outside its kept blocks.
    The last rows keep too few blocks for k finite scores (the emit walks the whole part for the
    -inf fill) or none, and visible lengths cut rows like a prefill.  The candidate mode is taken
    for every part size here (by default only from `_SEL_GATHER_CHUNKS` chunks a part)."""
    monkeypatch.setattr(K, "_SEL_GATHER_CHUNKS", 1)
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // K.BLOCK)
    vl = torch.full((s,), n, dtype=torch.int32)
    vl[-1] = max(1, n // 3)
    keep = torch.rand(b, s, nb, generator=g) < frac
    keep[-1, -1] = False
    if b * s > 1:
        keep[0, -1] = torch.rand(nb, generator=g) < max(1, k // 16) / nb  # fewer than k finite
    sc = random_scores(b, s, n, seed, vl).masked_fill(~K.expand_blocks(keep, n), float("-inf"))
    got = K.index_topk(sc.cuda(), vl.cuda(), keep.cuda(), k=k, offset=128)
    assert same(got.cpu(), K.index_topk_ref(sc, vl, k=k, offset=128)), f"seed={seed}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b,s,n,k", ((4, 5, 70000, 512), (32, 1, 262144, 512), (2, 3, 9000, 64)))
def test_cuda_topk_given_the_funnel_flags(b, s, n, k, monkeypatch):
    """The candidate source's top-k given its own funnel's flags (topk_blocks = 4k > k, as
    lower_indexer passes them): the scores outside the kept blocks are finite here, read by no
    one, and the lists equal the ref's over the whole rows (ties everywhere, a prefill-like row)."""
    monkeypatch.setattr(K, "_SEL_GATHER_CHUNKS", 1)
    seed = fresh_seed()
    vl = torch.full((s,), n, dtype=torch.int32)
    vl[-1] = max(1, n // 3)
    sc = random_scores(b, s, n, seed, vl, 0.3).cuda()
    vl = vl.cuda()
    keep = K.candidate_blocks(block_max_of(sc), vl, topk_blocks=4 * k)
    assert K.funnel_keeps_topk(4 * k, k) and not keep.all()
    got = K.index_topk(sc, vl, keep, k=k, offset=128)
    assert same(got.cpu(), K.index_topk_ref(sc.cpu(), vl.cpu(), k=k, offset=128)), f"seed={seed}"


@pytest.mark.gpu
@cuda
def test_cuda_topk_candidates_guarded(monkeypatch):
    """The candidate-mode select built with TileLang's bounds guards (`_SEL_UNGUARDED` 0; the
    default drops them), on the candidate and funnel-flag cases above."""
    monkeypatch.setattr(K, "_SEL_UNGUARDED", 0)
    K.build.cache_clear()  # builds are cached per op key, which does not name the switch
    try:
        for case in ((4, 5, 8195, 512, 0.06), (40, 15, 20000, 64, 0.3), (2, 3, 3001, 1, 0.01), (1, 1, 262144, 512, 0.0625)):
            test_cuda_topk_candidates(*case, monkeypatch)
        for case in ((4, 5, 70000, 512), (2, 3, 9000, 64)):
            test_cuda_topk_given_the_funnel_flags(*case, monkeypatch)
    finally:
        K.build.cache_clear()


def test_cuda_select_unguarded_build_lowers(monkeypatch):
    """Without a GPU: `_SEL_UNGUARDED` drops TileLang's bounds guards from the candidate-mode
    select (the flags' test against NB, the score loads' against N); the emit keeps its own guard
    of the output slots."""
    import tilelang

    from dsv41c.tilelang_kernels.quant import cuda_pass_configs
    tgt = {"kind": "cuda", "arch": "sm_90a"}
    for flag in (0, 1):
        monkeypatch.setattr(K, "_SEL_UNGUARDED", flag)
        for phase in K.SELECT_PHASES:
            main = K.select_prim_func("cand", phase, "cuda")
            with tilelang.tvm.transform.PassContext(config=cuda_pass_configs(main)), tilelang.tvm.target.Target(tgt):
                src = tilelang.lower(main, target=tgt).kernel_source.split("main_kernel")[-1]
            assert ("< NB)" in src and "(1 <= N)" in src) != bool(flag), (flag, phase)
            assert ("< KO)" in src) == (phase == "emit"), (flag, phase)


def test_cuda_select_split():
    for n, rows in ((1, 1), (2048, 1), (262144, 1), (262144, 32), (8192, 4), (70000, 20)):
        parts, part = K.cuda_select_split(n, rows)
        assert part % (K._SEL_THREADS * K._SEL_VEC) == 0 and (parts - 1) * part < n <= parts * part


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b", (1, 32))
def test_cuda_decode_chain_released_dims(b):
    """Scores -> funnel -> masked scores (the Reindex path) -> top-k 512 at ~8K keys: the
    selections are exact functions of the kernel's own scores."""
    seed, n = fresh_seed(), 8269
    q, codes, scales, w = make_inputs(b, 1, 32, 128, n, seed, device="cuda")
    vl = torch.tensor([n], dtype=torch.int32, device="cuda")
    sc, bm = K.index_scores(q, codes, scales, w, None, None, n=n, block_max=True)
    keep = K.candidate_blocks(bm, vl, topk_blocks=256)
    assert same(keep.cpu(), K.candidate_blocks_ref(bm.cpu(), vl.cpu(), topk_blocks=256)), f"seed={seed}"
    sc2, _ = K.index_scores(q, codes, scales, w, None, keep, n=n)
    assert same(sc2, sc.masked_fill(~K.expand_blocks(keep, n), float("-inf"))), f"seed={seed}"
    got = K.index_topk(sc2, vl, k=512, offset=128)
    assert same(got.cpu(), K.index_topk_ref(sc2.cpu(), vl.cpu(), k=512, offset=128)), f"seed={seed}"
    assert same(K.index_topk(sc2, vl, keep, k=512, offset=128), got), f"seed={seed}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("nb,kb", ((1024, 2048), (32768, 2048), (5000, 7)))
def test_cuda_funnel_bit_exact(nb, kb):
    seed, s = fresh_seed(), 3
    vl = torch.tensor([nb * 8, nb * 8 - 9, 1], dtype=torch.int32)
    bm = random_scores(2, s, nb, seed, None, 0.3)
    got = K.candidate_blocks(bm.cuda(), vl.cuda(), topk_blocks=kb)
    assert same(got.cpu(), K.candidate_blocks_ref(bm, vl, topk_blocks=kb)), f"seed={seed}"


@pytest.mark.gpu
@cuda
def test_cuda_opcheck():
    opcheck_all("cuda")
