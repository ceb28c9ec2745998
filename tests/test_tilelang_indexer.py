"""Indexer kernels (tilelang_kernels/indexer.py) against their refs and the eager indexer.

CPU tests run the C-target builds (each compiled once per process by `build`'s cache); `gpu` tests
run the CUDA builds and compare with the refs.  Inputs are fresh random every run (the seed is in
each failure message) with planted exact ties: queries with only non-negative entries against keys
with only non-positive ones score exactly 0, and duplicated key rows score identically.
"""

import secrets

import pytest
import torch

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

SCORE_CASES = {  # name: (B, S, H, d, n, ratio or None for decode)
    "prefill": (2, 13, 4, 64, 13, 1),
    "prefill_ratio4": (1, 30, 3, 32, 7, 4),
    "decode": (3, 1, 4, 64, 45, None),
    "decode_multi_query": (2, 3, 2, 128, 20, None),
}


@pytest.mark.parametrize("block_max", (False, True), ids=["scores", "blockmax"])
@pytest.mark.parametrize("with_cand", (False, True), ids=["all", "cand"])
@pytest.mark.parametrize("case", SCORE_CASES)
def test_scores_bit_exact_cpu(case, with_cand, block_max):
    b, s, h, d, n, ratio = SCORE_CASES[case]
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(b, s, h, d, n, seed)
    vl = prefill_visible(s, ratio) if ratio else None
    cand = torch.rand(b, s, -(-n // 8)) < 0.6 if with_cand else None
    got = K.index_scores(q, codes, scales, w, vl, cand, n=n, block_max=block_max)
    ref = K.index_scores_ref(q, codes, scales, w, vl, cand, n=n, block_max=block_max)
    assert same(got[0], ref[0]) and same(got[1], ref[1]), f"seed={seed}"
    assert (got[0] == 0).any(), f"seed={seed}: the planted zero scores are missing"


def test_scores_match_eager_indexer_cpu():
    """The ref is the eager §6.5(d): same bits as the eager Indexer's three lines on fake-quant keys."""
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(2, 9, 4, 64, 9, seed)
    keys = quant.mxfp4_dequant_ref(codes[:, :9], scales[:, :9], torch.bfloat16)
    eager = (torch.einsum("bshd,btd->bsht", q, keys).relu() * w.unsqueeze(-1)).sum(dim=2)
    got, _ = K.index_scores(q, codes, scales, w, n=9)
    assert same(got, eager), f"seed={seed}"


def test_scores_unquantised_queries_bound_cpu():
    """Plain bf16 queries: q.k is no longer exact in fp32, so the summation order can move a score
    by one bf16 rounding step: within 2^-7 relative of the largest score, and mostly equal."""
    seed = fresh_seed()
    q, codes, scales, w = make_inputs(2, 4, 8, 128, 64, seed, fq=False)
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
    q, codes, scales, w = make_inputs(1, s, 2, 32, n, seed)
    vl = torch.tensor([n, n - 1, 9, 1, 0], dtype=torch.int32)
    sc, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True)
    keep = K.candidate_blocks(bm, vl, topk_blocks=kb)
    assert same(keep, K.candidate_blocks_ref(bm, vl, topk_blocks=kb)), f"seed={seed}"
    funnel = type("Funnel", (), {"block_size": K.BLOCK, "topk_blocks": kb})()
    eager = Indexer.candidate_mask(funnel, sc.float(), vl.long())
    assert same(K.expand_blocks(keep, n), eager), f"seed={seed}"


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
    q, codes, scales, w = make_inputs(b, s, 4, 64, n, seed)
    q2, _, _, w2 = make_inputs(b, s, 4, 64, n, seed + 1)
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


def test_one_build_serves_all_shapes_cpu():
    before = K.build.cache_info().currsize
    for b, s, n in ((1, 1, 9), (2, 3, 17), (3, 2, 64)):
        q, codes, scales, w = make_inputs(b, s, 2, 32, n, fresh_seed())
        sc, _ = K.index_scores(q, codes, scales, w, n=n)
        K.index_topk(sc, torch.full((s,), n, dtype=torch.int32), k=min(4, n), offset=0)
    assert K.build.cache_info().currsize - before <= 2


def test_bad_inputs_raise():
    q, codes, scales, w = make_inputs(1, 2, 2, 32, 8, 0)
    with pytest.raises(ValueError, match="q must be"):
        K.index_scores(q.float(), codes, scales, w, n=8)
    with pytest.raises(ValueError, match="n=12"):
        K.index_scores(q, codes, scales, w, n=12)
    with pytest.raises(ValueError, match="visible_len"):
        K.index_scores(q, codes, scales, w, torch.zeros(3, dtype=torch.int32), n=8)
    with pytest.raises(ValueError, match="k=9"):
        K.index_topk(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), k=9, offset=0)


def opcheck_all(device):
    b, s, n = 2, 5, 21
    q, codes, scales, w = make_inputs(b, s, 2, 32, n, fresh_seed(), device=device)
    vl = prefill_visible(s, 1, device) + 16
    cand = torch.rand(b, s, 3, device=device) < 0.5
    torch.library.opcheck(torch.ops.dsv41c.index_scores, (q, codes, scales, w, vl, cand),
                          {"n": n, "block_max": True}, test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.dsv41c.index_scores, (q, codes, scales, w, None, None),
                          {"n": n, "block_max": False}, test_utils=OPCHECK)
    sc, bm = K.index_scores(q, codes, scales, w, vl, n=n, block_max=True)
    torch.library.opcheck(torch.ops.dsv41c.index_topk, (sc, vl), {"k": 7, "offset": 3}, test_utils=OPCHECK)
    torch.library.opcheck(torch.ops.dsv41c.candidate_blocks, (bm, vl), {"topk_blocks": 2}, test_utils=OPCHECK)


def test_opcheck_cpu():
    opcheck_all("cpu")
