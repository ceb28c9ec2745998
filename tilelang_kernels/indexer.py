"""Indexer kernels (MODEL.md §6.5, §6.9): scores straight from the MXFP4 index keys, top-k, funnel.

Ops (`torch.ops.dsv41c.*`); B sequences, S queries, H index heads of width d (a multiple of 32),
n keys, nb = ceil(n / block) candidate blocks of `block` entries (b_c of §6.9, 8 in the released
config; every op takes `block`, default 8; the CUDA builds take blocks of 8 only, the C builds
any):
  index_scores(q [B,S,H,d] bf16, codes u8 [B,>=n,d/2], scales u8 [B,>=n,d/32], w [B,S,H] bf16,
               visible_len int32 [S] or None, cand_blocks bool [B,S,nb] or None, *, n, block_max,
               block)
      -> (scores [B,S,n] bf16, block max [B,S,nb] bf16, or [B,S,0] without block_max)
      score[b,s,t] = sum_h relu(q[b,s,h] . K[b,t]) * w[b,s,h] with the bf16 rounding points of
      §6.5(d); -inf where t >= visible_len[s] (prefill; None in decode: all visible) and where
      the candidate block t // block is not kept.  The keys are the packed cache (a RowStore's
      `codes`/`scales`, rows 0..n-1 are read, so the whole cache buffer can be passed).
  index_topk(scores [B,S,n] bf16, visible_len int32 [S], cand_blocks bool [B,S,nb] or None, *,
             k, offset, block) -> int32 [B,S,k]
      the k largest scores per query, ties to the lower index, ascending; indices >= visible_len
      become -1, the others get + offset (§6.5(g), the -inf fill quirk included).  cand_blocks
      is a promise about the scores: the kept blocks hold every entry the top-k selects or, in a
      row with fewer than k finite scores, every finite score.  The CUDA build then reads only
      the kept blocks' scores (a row keeps 2049 of 32768 blocks at 256K) and counts the others
      as -inf; the result is the same.  Flags that keep it: the ones `index_scores` masked the
      scores with (every finite score is kept), and `candidate_blocks` over the scores' own block
      maxima with topk_blocks > k (see `funnel_keeps_topk`).  The C build reads the whole row, and
      so does the CUDA build with blocks of other than 8 entries.
  candidate_blocks(block_max [B,S,nb] bf16, visible_len int32 [S], *, topk_blocks, block)
      -> keep bool [B,S,nb]: the newest block (visible_len-1)//block pinned, the top
      min(topk_blocks, nb) blocks, ties to the lower index, kept iff also > -inf (§6.9).
      `expand_blocks(keep, n)` is the entry mask the eager model publishes.

Tie-breaking.  The spec leaves it to the implementation; here a lower index always wins (as in
the fp32 twin `dsv41c.attention.top_indices`), which also makes prefill and decode agree.  The refs
below use that rule (a stable descending sort of the exact fp32 image of the bf16 scores).

How the selection works.  A bf16 score maps to a 16-bit key that orders like the value (-0 is
+0).  Two 256-bin histograms (high byte, then the low byte within the threshold bin) find the
k-th largest key T and how many keys equal to T are needed; one more pass over the indices in
ascending order emits every key > T and the first `need` keys == T, so the output is already
sorted.  The funnel is the same select over block maxima with the newest block's key set to +inf.

Numerics of the scores.  The keys dequantise exactly (E2M1 x 2^k); each q.k is an fp32 sum
rounded once to bf16, relu, times w rounded to bf16, summed over heads in order h = 0..H-1 in fp32
and rounded once.  With MXFP4 queries (the model's fake quant) every product is exact and so is
every partial sum of q.k unless the four 32-blocks' scales span more than ~10 binades, so the
C build reproduces the eager bf16 computation bit for bit (the tests check bit equality on
fresh random inputs); with plain bf16 queries the summation order can move a score by one bf16
step (the tests bound it).

CPU (C target): one program per query, serial loops.  bf16 travels as its uint16 bits.

CUDA (sm_90a): the scoring decodes the keys on the ALU straight into a bf16 operand tile with
the UE8M0 scale folded in (exact: it is the dequantised key the ref multiplies), and runs one
[128 keys x d] x [d x H] GEMM per tile on the tensor cores (wgmma); each CTA walks a range of
tiles with the next tile's key bytes in flight during the current tile's GEMM and epilogue.  The
summation order inside the GEMM and over the heads differs from the C build's, so a score may move
by one bf16 step where a sum is inexact (rare; the GPU tests bound it).  The select splits each
row over many CTAs in three launches.  Details in `_cuda_scores_prim_func` and
`_cuda_select_prim_func`.
"""

import functools

import tilelang.cpu.language as TC
import tilelang.language as T
import torch
import torch.nn.functional as F
from dsv41c.tilelang_kernels.quant import (
    CUDA_E2M1_WORDS,
    NO_GUARD_ATTR,
    NO_SYNC_ATTR,
    _e2m1_value,
    _e8m0_value,
    _store,
    compile_for,
    define_op,
    kernel_target,
    rows_buffer,
)

from dsv41c import quant
from dsv41c.attention import Indexer, pad_to, top_indices
from dsv41c.attention import index_scores as eager_index_scores  # the op below is index_scores

__all__ = ["BLOCK", "index_scores", "index_scores_ref", "index_topk", "index_topk_ref", "candidate_blocks",
           "candidate_blocks_ref", "expand_blocks", "funnel_keeps_topk", "build", "scores_prim_func",
           "select_prim_func"]

BLOCK = 8  # candidate block size b_c (§6.9)
_NEG_INF_BF16 = 0xFF80
_KEY_NEG_INF = 0x007F  # order key of -inf
_KEY_POS_INF = 0xFF80  # order key of +inf


# ------------------------------------------------------------------------------------- refs

def _invisible(visible_len: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=visible_len.device) >= visible_len.view(-1, 1)


def expand_blocks(keep: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """Block keep flags [..., nb] -> the entry mask [..., n] (each flag repeated `block` times, cut)."""
    return keep.repeat_interleave(block, dim=-1)[..., :n]


def index_scores_ref(q, codes, scales, w, visible_len=None, cand_blocks=None, *, n=None, block_max=False,
                     block=BLOCK):
    """What `index_scores` computes, from the eager code on the dequantised keys (same args)."""
    n = codes.shape[1] if n is None else n
    keys = quant.mxfp4_dequant_ref(codes[:, :n], scales[:, :n], torch.bfloat16)
    scores = eager_index_scores(q, keys, w)
    if visible_len is not None:
        scores = scores.masked_fill(_invisible(visible_len, n), float("-inf"))
    if cand_blocks is not None:
        scores = scores.masked_fill(~expand_blocks(cand_blocks, n, block), float("-inf"))
    nb = -(-n // block)
    if not block_max:
        return scores, scores.new_empty(*scores.shape[:2], 0)
    padded = F.pad(scores, (0, nb * block - n), value=float("-inf"))
    return scores, padded.unflatten(-1, (nb, block)).amax(dim=-1)


def index_topk_ref(scores, visible_len, *, k, offset):
    """§6.5(g) with ties to the lower index: `top_indices` of the exact fp32 image, sorted.  k may
    exceed the number of scores n: the scores are padded with -inf like the model's (`pad_to`), so
    the slots past n are -1."""
    idx = top_indices(pad_to(scores.float(), k), k).sort(dim=-1).values
    return torch.where(idx >= visible_len.view(1, -1, 1), -1, idx + offset).int()


def funnel_keeps_topk(topk_blocks: int, k: int) -> bool:
    """Whether the funnel's flags over a row's own block maxima (`candidate_blocks`) keep every
    entry the row's top-k selects, so `index_topk` may be given them: true for topk_blocks > k.

    Let T be the k-th largest score.  If T > -inf: the blocks holding a score > T number at most
    #(> T) = k - need and outrank every other block but the pinned one, so with the pin they fit
    in k + 1 - need slots; the first `need` entries == T (index order) lie in blocks whose max is
    >= T, and those with max == T are the lowest-index such blocks (a lower one would hold an
    earlier entry == T), at most `need` of them, next in the funnel's order: k + 1 slots in all.
    If T = -inf (fewer than k finite scores), the finite blocks are fewer than k + 1 and all kept.
    A property test checks this on the refs (tests/test_tilelang_indexer.py)."""
    return topk_blocks > k


def candidate_blocks_ref(block_max, visible_len, *, topk_blocks, block=BLOCK):
    """§6.9 steps 2-3 by `Indexer.candidate_mask` (ties to the lower index), as block flags."""
    funnel = type("Funnel", (), {"block_size": 1, "topk_blocks": topk_blocks})()
    # with block_size 1 over the block maxima, candidate_mask pins entry (its visible_len) - 1
    newest_block = (visible_len - 1).div(block, rounding_mode="floor")
    return Indexer.candidate_mask(funnel, block_max.float(), newest_block + 1)


# ------------------------------------------------------------------------------------- shared TIR

def _u(v):
    return T.uint32(v)


def _f(bits):
    return T.reinterpret(bits, "float32")


def _bf16_value(h):
    """fp32 value of bf16 bits h (a uint16 or uint32 expression)."""
    return _f(T.Cast("uint32", h) << _u(16))


def _round_bf16(x):
    """x rounded to bf16 (round to nearest even, finite inputs), as an fp32 value."""
    return _bf16_value(_store("uint16", x))


def _order_key(h):
    """16-bit key (uint32) ordering bf16 bits h like their values; -0 maps with +0."""
    b = T.Cast("uint32", h)
    b = T.Select(b == _u(0x8000), _u(0), b)
    return T.Select((b & _u(0x8000)) != _u(0), (~b) & _u(0xFFFF), b | _u(0x8000))


def _nonzero_bf16(x_bits):
    """bf16 bits with -0 replaced by +0 (a sum of zeros has no meaningful sign)."""
    return T.Select(x_bits == T.Cast("uint16", 0x8000), T.Cast("uint16", 0), x_bits)


def _sel_key(h, i, newest, blocks):
    """Order key of entry i with bf16 bits h; the funnel pins block `newest` to +inf."""
    k = _order_key(h)
    return T.Select(i == newest, _u(_KEY_POS_INF), k) if blocks else k


# ------------------------------------------------------------------------------------- C builds

def _cpu_scores_prim_func(H, d, visible, cand, bmax, block):
    N, NC, NB = T.dynamic("N"), T.dynamic("NC"), T.dynamic("NB")
    B, S = T.dynamic("B"), T.dynamic("S")
    nsb = d // 32

    @T.prim_func
    def main(Q: T.Tensor((B, S, H, d), "uint16"), CODES: T.Tensor((B, NC, d // 2), "uint8"),
             SCALES: T.Tensor((B, NC, nsb), "uint8"), W: T.Tensor((B, S, H), "uint16"),
             VL: T.Tensor((S,) if visible else (1,), "int32"),
             CAND: T.Tensor((B, S, NB) if cand else (1,), "uint8"),
             SC: T.Tensor((B, S, N), "uint16"), BM: T.Tensor((B, S, NB) if bmax else (1,), "uint16")):
        with TC.Kernel(S, B) as (s, b):
            qf = T.alloc_local((H, d), "float32")
            wf = T.alloc_local((H,), "float32")
            kf = T.alloc_local((d,), "float32")
            acc = T.alloc_var("float32")
            tot = T.alloc_var("float32")
            bm = T.alloc_var("float32")
            for h in T.serial(H):
                wf[h] = _bf16_value(W[b, s, h])
                for i in T.serial(d):
                    qf[h, i] = _bf16_value(Q[b, s, h, i])
            for t in T.serial(N):
                for j in T.serial(nsb):
                    sc = _e8m0_value(T.Cast("uint32", SCALES[b, t, j]))
                    for i in T.serial(16):
                        p = T.Cast("uint32", CODES[b, t, j * 16 + i])
                        kf[j * 32 + 2 * i] = _e2m1_value(p & _u(0xF)) * sc
                        kf[j * 32 + 2 * i + 1] = _e2m1_value(p >> _u(4)) * sc
                tot = T.float32(0)
                for h in T.serial(H):
                    acc = T.float32(0)
                    for i in T.serial(d):
                        acc = acc + qf[h, i] * kf[i]
                    tot = tot + _round_bf16(T.max(_round_bf16(acc), T.float32(0)) * wf[h])
                out = _nonzero_bf16(_store("uint16", tot))
                if visible:
                    out = T.Select(t >= VL[s], T.Cast("uint16", _NEG_INF_BF16), out)
                if cand:
                    out = T.Select(CAND[b, s, t // block] == T.Cast("uint8", 0), T.Cast("uint16", _NEG_INF_BF16), out)
                SC[b, s, t] = out
            if bmax:
                for j in T.serial(NB):
                    bm = _bf16_value(_NEG_INF_BF16)
                    for i in T.serial(block):
                        if j * block + i < N:
                            bm = T.max(bm, _bf16_value(SC[b, s, j * block + i]))
                    BM[b, s, j] = _store("uint16", bm)
    return main


def _cpu_select_prim_func(mode, block):
    """mode "topk": K [B,S,k] int32 indices; mode "blocks": keep flags u8 [B,S,n] (pin newest, the
    block of entry visible_len - 1 in blocks of `block`)."""
    B, S, N, KO = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("KO")
    blocks = mode == "blocks"
    out_shape, out_dtype = ((B, S, N), "uint8") if blocks else ((B, S, KO), "int32")

    @T.prim_func
    def main(SC: T.Tensor((B, S, N), "uint16"), VL: T.Tensor((S,), "int32"), OUT: T.Tensor(out_shape, out_dtype),
             k: T.int32, offset: T.int32):
        with TC.Kernel(S, B) as (s, b):
            hist = T.alloc_local((256,), "int32")
            thr = T.alloc_var("uint32")
            above = T.alloc_var("int32")
            found = T.alloc_var("int32")
            pos = T.alloc_var("int32")
            eqc = T.alloc_var("int32")
            need = T.alloc_var("int32")
            kv = T.alloc_var("uint32")
            kk = k
            newest = T.Select(VL[s] > 0, (VL[s] - 1) // block, -1)

            T.clear(hist)
            for i in T.serial(N):
                kv = _sel_key(SC[b, s, i], i, newest, blocks)
                hist[T.Cast("int32", kv >> _u(8))] += 1
            above = 0
            found = 0
            thr = _u(0)
            for j in T.serial(256):
                if found == 0:
                    if above + hist[255 - j] >= kk:
                        thr = T.Cast("uint32", 255 - j)
                        found = 1
                    else:
                        above = above + hist[255 - j]
            T.clear(hist)
            for i in T.serial(N):
                kv = _sel_key(SC[b, s, i], i, newest, blocks)
                if (kv >> _u(8)) == thr:
                    hist[T.Cast("int32", kv & _u(0xFF))] += 1
            found = 0
            for j in T.serial(256):
                if found == 0:
                    if above + hist[255 - j] >= kk:
                        thr = (thr << _u(8)) | T.Cast("uint32", 255 - j)
                        found = 1
                    else:
                        above = above + hist[255 - j]
            need = kk - above
            pos = 0
            eqc = 0
            for i in T.serial(N):
                kv = _sel_key(SC[b, s, i], i, newest, blocks)
                if blocks:
                    OUT[b, s, i] = T.Cast("uint8", 0)
                if kv > thr or (kv == thr and eqc < need):
                    if blocks:
                        OUT[b, s, i] = T.Cast("uint8", kv > _u(_KEY_NEG_INF))
                    else:
                        OUT[b, s, pos] = T.Select(i >= VL[s], -1, i + offset)
                    pos = pos + 1
                if kv == thr:
                    eqc = eqc + 1
    return main


# ------------------------------------------------------------------------------------- builds

def scores_prim_func(H: int, d: int, visible: bool, cand: bool, bmax: bool, target: str, block: int = BLOCK):
    """The scoring prim_func for H heads of width d; flags: causal mask, candidate blocks (of `block`
    entries), block max."""
    if d % 32 or H < 1 or block < 1:
        raise ValueError(f"index_scores: need d a multiple of 32, H >= 1 and block >= 1, got H={H}, d={d}, "
                         f"block={block}")
    if target == "c":
        return _cpu_scores_prim_func(H, d, visible, cand, bmax, block)
    if (cand or bmax) and block != BLOCK:
        raise ValueError(f"index_scores: the CUDA build takes candidate blocks of {BLOCK} entries, got {block}")
    return _cuda_scores_prim_func(H, d, visible, cand, bmax)


def select_prim_func(mode: str, phase: str, target: str, block: int = BLOCK):
    """The selection prim_func, mode "topk" (indices), "blocks" (funnel keep flags, the newest of
    the blocks of `block` entries pinned) or, CUDA only, "cand" (indices, reading only the
    candidate blocks' scores, blocks of 8); the C build does everything in one phase "all", the
    CUDA build is split in SELECT_PHASES."""
    modes = ("topk", "blocks") if target == "c" else ("topk", "blocks", "cand")
    if mode not in modes or phase not in (("all",) if target == "c" else SELECT_PHASES) or block < 1:
        raise ValueError(f"indexer select: unknown mode/phase/block {mode!r}/{phase!r}/{block} for target {target}")
    if target == "c":
        return _cpu_select_prim_func(mode, block)
    if mode == "cand" and block != BLOCK:
        raise ValueError(f"indexer select: the CUDA candidate mode takes blocks of {BLOCK} entries, got {block}")
    return _cuda_select_prim_func(mode, phase, block)


@functools.cache
def build(kind: str, key: tuple, target: str, block: int = BLOCK):
    """Compiled kernel, once per process per (kind "scores"/"select", key, target, candidate block
    size); target "c" (CPU) or "cuda:sm_XX"."""
    cpu = target == "c"
    fn = (scores_prim_func if kind == "scores" else select_prim_func)(*key, "c" if cpu else "cuda", block)
    return compile_for(fn, target)



def _bits(t: torch.Tensor, target: str) -> torch.Tensor:
    """bf16 as its uint16 bits for the C build (zero-copy view); as is for CUDA."""
    return t.view(torch.uint16) if target == "c" and t.dtype == torch.bfloat16 else t


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The CUDA build reads q and the codes with 16-byte loads: copy a misaligned view."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ------------------------------------------------------------------------------------- torch.library ops

def _check_scores(q, codes, scales, w, visible_len, cand_blocks, n, block):
    if q.dim() != 4 or q.dtype != torch.bfloat16:
        raise ValueError(f"index_scores: q must be [B,S,H,d] bf16, got {q.dtype} {tuple(q.shape)}")
    b, s, h, d = q.shape
    if d % 32:
        raise ValueError(f"index_scores: head dim d must be a multiple of 32, got {d}")
    want = {"codes": ((b, None, d // 2), torch.uint8, codes), "scales": ((b, None, d // 32), torch.uint8, scales),
            "w": ((b, s, h), torch.bfloat16, w)}
    if visible_len is not None:
        want["visible_len"] = ((s,), torch.int32, visible_len)
    if block < 1:
        raise ValueError(f"index_scores: block must be >= 1, got {block}")
    nb = -(-n // block)
    if cand_blocks is not None:
        want["cand_blocks"] = ((b, s, nb), torch.bool, cand_blocks)
    for name, (shape, dtype, t) in want.items():
        ok = t.dim() == len(shape) and all(x is None or x == y for x, y in zip(shape, t.shape, strict=False))
        if not ok or t.dtype != dtype or t.device != q.device:
            raise ValueError(f"index_scores: {name} must be {dtype} {tuple('*' if x is None else x for x in shape)} "
                             f"on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not 0 <= n <= min(codes.shape[1], scales.shape[1]):
        raise ValueError(f"index_scores: n={n} keys, but the cache holds {codes.shape[1]} / {scales.shape[1]} rows")
    return b, s, h, d, nb


def _scores_fake(q, codes, scales, w, visible_len, cand_blocks, n, block_max, block=BLOCK):
    b, s = q.shape[:2]
    return q.new_empty((b, s, n)), q.new_empty((b, s, -(-n // block) if block_max else 0))


def _scores_impl(q, codes, scales, w, visible_len, cand_blocks, n, block_max, block=BLOCK):
    b, s, h, d, nb = _check_scores(q, codes, scales, w, visible_len, cand_blocks, n, block)
    sc, bm = _scores_fake(q, codes, scales, w, visible_len, cand_blocks, n, block_max, block)
    if sc.numel() == 0:
        return sc, bm
    target = kernel_target(q, "indexer")
    # (the block size matters only with candidate flags or block maxima: one build for the rest)
    kernel = build("scores", (h, d, visible_len is not None, cand_blocks is not None, block_max), target,
                   block if cand_blocks is not None or block_max else BLOCK)
    # the keys' buffers as allocated (a cache read [:B, :n] is not copied): keys from n on are never read
    args = [_bits(_aligned(q.contiguous()), target), _aligned(rows_buffer(codes)), _aligned(rows_buffer(scales)),
            _bits(w.contiguous(), target)]
    # an unused optional buffer is declared [1] by the build and never touched: uninitialised (a
    # zero fill would be one more kernel launch per call)
    args.append(visible_len.contiguous() if visible_len is not None else q.new_empty(1, dtype=torch.int32))
    args.append(cand_blocks.contiguous().view(torch.uint8) if cand_blocks is not None
                else q.new_empty(1, dtype=torch.uint8))
    args.append(_bits(sc, target))
    args.append(_bits(bm, target) if block_max else _bits(q.new_empty(1), target))
    if target != "c":
        args.append(cuda_tiles_per_cta(n, b * s))
    kernel(*args)
    return sc, bm


def _check_select(op, scores, visible_len):
    if scores.dim() != 3 or scores.dtype != torch.bfloat16:
        raise ValueError(f"{op}: scores must be [B,S,n] bf16, got {scores.dtype} {tuple(scores.shape)}")
    if visible_len.shape != (scores.shape[1],) or visible_len.dtype != torch.int32 or visible_len.device != scores.device:
        raise ValueError(f"{op}: visible_len must be int32 [{scores.shape[1]}] on {scores.device}, "
                         f"got {visible_len.dtype} {tuple(visible_len.shape)} on {visible_len.device}")


def _select(mode, scores, visible_len, k, offset, out, cand_blocks=None, phases=None, block=BLOCK):
    """Run the select build(s) of `mode` on scores [B,S,n] (k >= 1) into out; in top-k mode the
    CUDA build reads only the blocks `cand_blocks` keeps (see index_topk).  `phases`: the CUDA
    launches to run after the histograms are zeroed (default all of SELECT_PHASES;
    benchmarks/indexer.py times each prefix)."""
    target = kernel_target(scores, "indexer")
    sc = scores.contiguous().view(torch.uint16)
    vl = visible_len.contiguous()
    # k and offset are scalar kernel arguments: a device tensor of them would cost a host-to-device
    # copy that synchronises the host with the GPU on every call and breaks CUDA graph capture
    if target == "c":
        build("select", (mode, "all"), target, block)(sc, vl, out, k, offset)
        return
    b, s, n = scores.shape
    parts, part = cuda_select_split(n, b * s)
    if cand_blocks is not None and cuda_select_gathers(part):
        mode, cand = "cand", cand_blocks.contiguous().view(torch.uint8)
    else:  # unread: an uninitialised [1,1,1]
        cand = sc.new_empty((1, 1, 1), dtype=torch.uint8)
    hist = torch.zeros(b, s, 2, 256, dtype=torch.int32, device=scores.device)
    part_hist = torch.empty(b, s, parts, 257, dtype=torch.int32, device=scores.device)
    for phase in SELECT_PHASES if phases is None else phases:
        build("select", (mode, phase), target, block)(sc, vl, cand, hist, part_hist, out, part, k, offset)


def _topk_fake(scores, visible_len, cand_blocks=None, *, k, offset, block=BLOCK):
    return scores.new_empty((*scores.shape[:2], k), dtype=torch.int32)


def _topk_impl(scores, visible_len, cand_blocks=None, *, k, offset, block=BLOCK):
    _check_select("index_topk", scores, visible_len)
    if k < 0 or block < 1:
        raise ValueError(f"index_topk: k={k} must be >= 0 and block={block} >= 1")
    nb = (*scores.shape[:2], -(-scores.shape[-1] // block))
    if cand_blocks is not None and (cand_blocks.shape != nb or cand_blocks.dtype != torch.bool
                                    or cand_blocks.device != scores.device):
        raise ValueError(f"index_topk: cand_blocks must be bool {nb} on {scores.device}, got "
                         f"{cand_blocks.dtype} {tuple(cand_blocks.shape)} on {cand_blocks.device}")
    out = _topk_fake(scores, visible_len, cand_blocks, k=k, offset=offset)
    if block != BLOCK:  # the flags are a promise about the scores (docstring): the whole row gives the same list
        cand_blocks = None
    n = scores.shape[-1]
    if k >= n:  # every score is selected, sorted: 0..n-1, then the model's -inf padding (-1 slots)
        idx = torch.arange(k, dtype=torch.int32, device=scores.device).expand_as(out)
        out.copy_(torch.where(idx >= visible_len.view(1, -1, 1).clamp(max=n), -1, idx + offset))
    elif out.numel():
        _select("topk", scores, visible_len, k, offset, out, cand_blocks)
    return out


def _blocks_fake(block_max, visible_len, topk_blocks, block=BLOCK):
    return block_max.new_empty(block_max.shape, dtype=torch.bool)


def _blocks_impl(block_max, visible_len, topk_blocks, block=BLOCK):
    _check_select("candidate_blocks", block_max, visible_len)
    if topk_blocks < 0 or block < 1:
        raise ValueError(f"candidate_blocks: topk_blocks must be >= 0 and block >= 1, got {topk_blocks}, {block}")
    out = _blocks_fake(block_max, visible_len, topk_blocks)
    if out.numel():
        kb = min(topk_blocks, block_max.shape[-1])
        if kb == 0:
            return out.zero_()
        _select("blocks", block_max, visible_len, kb, 0, out.view(torch.uint8), block=block)
    return out


_OPS = {}
for _name, _impl, _fake, _schema in (
        ("index_scores", _scores_impl, _scores_fake,
         "(Tensor q, Tensor codes, Tensor scales, Tensor w, Tensor? visible_len, Tensor? cand_blocks, *, "
         "SymInt n, bool block_max, int block=8) -> (Tensor, Tensor)"),
        ("index_topk", _topk_impl, _topk_fake,
         "(Tensor scores, Tensor visible_len, Tensor? cand_blocks=None, *, SymInt k, SymInt offset, int block=8) "
         "-> Tensor"),
        ("candidate_blocks", _blocks_impl, _blocks_fake,
         "(Tensor block_max, Tensor visible_len, *, SymInt topk_blocks, int block=8) -> Tensor")):
    _OPS[_name] = define_op(_name, _schema, _impl, _fake)


def index_scores(q, codes, scales, w, visible_len=None, cand_blocks=None, *, n=None, block_max=False, block=BLOCK):
    """Scores [B,S,n] bf16 and block max [B,S,nb] (or [B,S,0]); = index_scores_ref."""
    return torch.ops.dsv41c.index_scores(q, codes, scales, w, visible_len, cand_blocks,
                                         n=codes.shape[1] if n is None else n, block_max=block_max, block=block)


def index_topk(scores, visible_len, cand_blocks=None, *, k, offset, block=BLOCK):
    """Top-k indices int32 [B,S,k], ascending, -1 past visible_len, + offset; = index_topk_ref."""
    return torch.ops.dsv41c.index_topk(scores, visible_len, cand_blocks, k=k, offset=offset, block=block)


def candidate_blocks(block_max, visible_len, *, topk_blocks, block=BLOCK):
    """Funnel keep flags bool [B,S,nb] from the block maxima; = candidate_blocks_ref."""
    return torch.ops.dsv41c.candidate_blocks(block_max, visible_len, topk_blocks=topk_blocks, block=block)


# ------------------------------------------------------------------------------------- CUDA builds

_BN = 128  # CUDA scoring: keys per tile (the GEMM's M), one thread per key in the epilogue
_THREADS = 128  # one warpgroup multiplying the tile's keys (= _BN)
# scoring CTAs resident per SM: the wave `cuda_tiles_per_cta` plans for, and the launch bounds' minimum
# (the register budget).  5 at the defaults (88 registers x 128 threads a CTA, about 9 KB of shared
# memory with the keys in registers): the CTAs' phases (loads, decode, GEMM, epilogue) overlap
# across more independent CTAs.  Timed on an H200 against 2 CTAs of 256 keys (two warpgroups, 87
# registers) and 3 of 256 (71 registers), and with the keys in registers against 6 (80 registers,
# small spills: slower): BENCHMARKS.md, indexer section.
_CTAS_PER_SM = 5
# key tiles a scoring CTA walks at most (`cuda_tiles_per_cta`).  The CTAs' setups (the query tile,
# latency-bound) overlap other CTAs' walks (ALU-bound): on an H200 at batch 32, 256K one wave of
# 640 CTAs walking 103 tiles each, a sixth of the setups, was slower than 4096 CTAs of 16 tiles
# side by side (292.8 against 281.6 us; BENCHMARKS.md).
_MAX_TPC = 16
# CUDA scoring: the sum over heads as a second wgmma (the bf16 products relu(q.k) x w, left in
# registers as its A operand, against a [H, 8] tile of ones) instead of fp32 adds and shuffles:
# 5% faster at batch 32, 256K on an H200 (BENCHMARKS.md).  Its fp32 sum is in another order than
# the adds', as any order is (the ref's bf16 matmul fixes none); one warpgroup (_THREADS 128) and
# H a multiple of 16 only, else the adds.
_HEAD_SUM_MMA = 1
# CUDA scoring: the decoded keys stay in registers as the GEMM's A operand (wgmma with a register
# A fragment) instead of going through a shared [_BN, d] tile: no key tile in shared memory, no
# barrier before the GEMM.  d 128 and one warpgroup only (thread lane % 4 decodes scale block
# lane % 4 of its four rows), else the shared tile.  1.10x at batch 32, 256K on an H200
# (BENCHMARKS.md).
_KEYS_IN_REGS = 1
# CUDA scoring: built without TileLang's bounds guards on global accesses (NO_GUARD_ATTR).  Every
# access is guarded in the kernel already: key loads by t < lim <= n <= the cache rows
# (`_check_scores`), score and block-max stores by t < N, the candidate flags by a clamp and blk <
# NB, q and w by the grid.  The static tile loop drops 898 -> 823 SASS instructions; 1.08x at
# batch 32, 256K on an H200 (BENCHMARKS.md).
_UNGUARDED = 1
# CUDA scoring: the keys' GEMM on E4M3 operands (wgmma m64n32k32, the keys' register A fragment
# decoded by byte permutes, `dsv41c_decode_frag8`) wherever that is exact, else the bf16 path in
# the same kernel.  The index queries are MXFP4 (§6.5(b)): head h's values are E4M3 exactly once
# divided by 2^m_h, where m_h puts its largest |q| in [256, 512), and m_h goes into the weight,
# w' = w x 2^m_h.  A key's blocks go in as E2M1 x 2^(s - min_s - 5), which E4M3 holds for a spread
# of scale bytes s - min_s <= 11, and 2^(min_s - 122) multiplies the key's head sum.  Every power of
# two commutes with the ref's roundings while no intermediate leaves the normal range, which the
# kernel checks: per CTA, the queries' E4M3 conversion exact and w' normal; per key, the spread, no
# scale byte above 252 (the ref's bf16 key would be inf or NaN there) and min_s in a window set by
# the query's m_h and w (`dsv41c_fp8_head`).  A CTA whose query fails, or a tile with a failing key
# (from that tile on), takes the bf16 path.
# d 128 with the keys in registers and the head sum on the tensor cores only, and not for the
# candidate-gathering build (Reindex), whose CTAs walk a tile or two: there the per-CTA setup costs
# more than the GEMM saves.  The bf16 path runs as two GEMMs of k 64 (a half-width fragment: 95
# registers, no spills at 5 CTAs per SM; with the whole fragment it spills there).  At batch 32,
# 256K on an H200: 308.7 -> 270.7 us; Reindex on it went 62.2 -> 80.7 us (BENCHMARKS.md).
_FP8_KEYS = 1
# tests only: the E4M3 build's bf16 path writes NaN products, so that a test sees which keys took
# the E4M3 path (those scores stay right) and which the bf16 one
_FP8_POISON_BF16_PATH = 0


def fp8_scoring(H: int, d: int, cand: bool) -> bool:
    """Whether the CUDA scoring build for H heads of width d (candidate gathering `cand`) takes
    the E4M3 keys' GEMM (`_FP8_KEYS`)."""
    return (bool(_FP8_KEYS) and d == 128 and _BN == _THREADS == 128 and bool(_KEYS_IN_REGS)
            and bool(_HEAD_SUM_MMA) and H % 16 == 0 and not cand)

# Decode of one key's scale block (16 code bytes, one UE8M0 byte) into 32 bf16 operand values with
# the scale folded in, on the ALU (no table, no shared memory).  Code nibble j of a 32-bit word
# (bits 4j..4j+3: sign bit 3, magnitude e1 e0 m) is element j of the word's 8.  Nibbles j and
# j + 4 go into one bf16x2 word by two shifts and masks: magnitude bits to bf16 bits 8..6 (exponent
# low bits and the top mantissa bit) and the sign to bit 15, which spells E2M1 x 2^-126 exactly
# (code 1, 0.5, becomes the bf16 subnormal 2^-127).  Two bf16x2 multiplies by 2^126 and by the
# block scale 2^(s-127) give E2M1 x 2^(s-127) rounded to nearest even: exact wherever the bf16
# dequantised key (the ref) is finite, inf where that overflows; bf16 multiplies keep subnormals.
# Where every lane of the warp has s <= 128 (a vote keeps the branch warp-uniform), one multiply by
# 2^(s-1), a bf16 there, instead: the same single rounding of the same exact product.
# The 8 values of a word are stored as (0,4), (1,5), (2,6), (3,7): the query is permuted the same
# way (`_qperm`), so the dot products are unchanged.
_DECODE_PRELUDE = CUDA_E2M1_WORDS + r"""
// The n words o[] of E2M1 x 2^-126 times the scale 2^(s-127) of UE8M0 byte s.
template <int n>
__device__ __forceinline__ void dsv41c_scale_words(unsigned s, unsigned* o) {
  if (__all_sync(0xffffffffu, s <= 128u)) {
    unsigned f = (s + 126u) << 7;  // bf16 bits of 2^(s-1)
    f |= f << 16;
#pragma unroll
    for (int r = 0; r < n; ++r) o[r] = dsv41c_mul_bf16x2(o[r], f);
  } else {
    unsigned sb = s == 0u ? 0x0040u : (s == 255u ? 0x7FC0u : s << 7);  // bf16 bits of 2^(s-127)
    unsigned scale2 = sb | (sb << 16);
#pragma unroll
    for (int r = 0; r < n; ++r) o[r] = dsv41c_mul_bf16x2(dsv41c_mul_bf16x2(o[r], 0x7E807E80u), scale2);
  }
}

// 16 code bytes at `codes` (16-byte aligned registers) and scale byte `s` -> the 16 bf16x2 words
// o[4q + i] (nibbles i and i + 4 of code word q: dims 8q + i and 8q + i + 4 of the scale block).
__device__ __forceinline__ void dsv41c_decode16(const void* codes, unsigned s, unsigned* o) {
  uint4 c = *reinterpret_cast<const uint4*>(codes);
  unsigned words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) dsv41c_e2m1_words(words[q], o + 4 * q);
  dsv41c_scale_words<16>(s, o);
}

// Code words 2k and 2k + 1 of a unit (8 bytes at `codes`) into the half-width (k 64) register A
// fragment of its k half k, rows h: the words 8k .. 8k + 7 of `dsv41c_decode_frag`.
__device__ __forceinline__ void dsv41c_decode_frag_half(const void* codes, unsigned s, void* frag, int h) {
  uint2 c = *reinterpret_cast<const uint2*>(codes);
  unsigned o[8];
  dsv41c_e2m1_words(c.x, o);
  dsv41c_e2m1_words(c.y, o + 4);
  dsv41c_scale_words<8>(s, o);
#pragma unroll
  for (int r = 0; r < 8; ++r) reinterpret_cast<unsigned*>(frag)[(r / 2) * 4 + (r % 2) * 2 + h] = o[r];
}

// The same as 32 bf16 at `out` (16-byte aligned), word 4q + i at out word 4q + i.
__device__ __forceinline__ void dsv41c_decode_block(const void* codes, unsigned s, void* out) {
  unsigned o[16];
  dsv41c_decode16(codes, s, o);
#pragma unroll
  for (int q = 0; q < 4; ++q) reinterpret_cast<uint4*>(out)[q] = make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
}

// The same into a wgmma register A fragment of 64 keys x 128 dims (m64k16 per instruction), as
// row h of the thread's two rows: word r = 4q + i is k step r / 2, column half r % 2, so it lands
// at fragment word (r / 2) * 4 + (r % 2) * 2 + h (`_qperm_regs`).  The caller's unrolled h makes
// every index a constant: registers, not memory.
__device__ __forceinline__ void dsv41c_decode_frag(const void* codes, unsigned s, void* frag, int h) {
  unsigned o[16];
  dsv41c_decode16(codes, s, o);
#pragma unroll
  for (int r = 0; r < 16; ++r) reinterpret_cast<unsigned*>(frag)[(r / 2) * 4 + (r % 2) * 2 + h] = o[r];
}

// ---- FP8 keys (`_FP8_KEYS`): E2M1 codes to E4M3 bytes by byte permutes, no multiplies.
// Byte permute: the bytes of {b, a} picked by the 4 selector nibbles of c (bit 3 of a nibble: the
// selected byte's sign bit replicated).
__device__ __forceinline__ unsigned dsv41c_prmt(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// 16 code bytes at `codes` and the scale offset j = s - (the least scale byte of the key's blocks),
// 0..11, into the rows h of a wgmma m64k32 E4M3 register A fragment (`_frag_a8`).  Magnitude code
// c = e1 e0 m goes through an 8-byte table of E4M3(E2M1(c) x 2^(j-5)): every nonzero entry is a
// normal E4M3 (2^-6 .. 384), j x 8 added to the exponent field, so two IMADs make the table.  The
// sign of nibble i (bit 4i + 3) goes to bit 7 of byte i: one permute of w << 4 and w takes bytes
// whose bit 7 is that sign.  Code word q (nibbles 0..3 and 4..7: dims 8q + 0..3 and 8q + 4..7 of
// the scale block) fills k step q, column halves 0 and 1 (`_qperm8`).
__device__ __forceinline__ void dsv41c_decode_frag8(const void* codes, unsigned j, void* frag, int h) {
  uint4 c = *reinterpret_cast<const uint4*>(codes);
  unsigned words[4] = {c.x, c.y, c.z, c.w};
  unsigned lo = 0x14100800u + j * 0x08080800u, hi = 0x24201C18u + j * 0x08080808u;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    unsigned w = words[q], m = w & 0x77777777u, w4 = w << 4;
    unsigned o0 = (dsv41c_prmt(w4, w, 0x5140u) & 0x80808080u) | dsv41c_prmt(lo, hi, m);
    unsigned o1 = (dsv41c_prmt(w4, w, 0x7362u) & 0x80808080u) | dsv41c_prmt(lo, hi, m >> 16);
    reinterpret_cast<unsigned*>(frag)[q * 4 + h] = o0;
    reinterpret_cast<unsigned*>(frag)[q * 4 + 2 + h] = o1;
  }
}

// The largest exponent field among 32 bf16 at p (16-byte aligned).
__device__ __forceinline__ int dsv41c_max_exp32(const void* p) {
  unsigned m = 0u;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint4 v = reinterpret_cast<const uint4*>(p)[k];
    unsigned x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) m = max(m, max(x[e] & 0x7F80u, (x[e] >> 16) & 0x7F80u));
  }
  return int(m >> 7);
}

// Head h of the E4M3 scoring, given mx, the largest exponent field of its query (its 128 bf16):
// m = mx - 135 puts its largest |q| in [256, 512); *ms = 2^-m divides the query, *ws8 = w x 2^m takes
// it back.  With K = min_s - 122 a key's own power of two, the ref's q.k is the kernel's fp32 sum
// (E4M3 products: multiples of 2^-16, below 2^25 in magnitude) times 2^(m + K); its products with w
// are the kernel's times 2^K, and so is their sum over heads, whose terms are bf16 of at least
// 2^(m + K + ew - 16) where 2^ew <= |w|.  All of it stays in the normal range, where powers of two
// commute with every rounding, while m + K lies in -110 .. 101 and (w nonzero) m + K + ew in
// -103 .. 95: the window of min_s = K + 122 this head allows, intersected into lim[0 .. 1].
// m + ew in -103 .. 95 keeps w' and the kernel's own products and sums normal.  A head outside
// these, with w subnormal, or with m < -117 (where a query value exact in E4M3 after the division
// may be a subnormal bf16) sets *bad: the CTA takes the bf16 path.  No input is subnormal on the
// E4M3 path (min_s >= 2 too), so no library's flush-to-zero can tell the two apart.
__device__ __forceinline__ void dsv41c_fp8_head(int mx, const void* w, void* ws8, void* ms, int* lim, int* bad) {
  unsigned wb = *reinterpret_cast<const unsigned short*>(w);
  int m = mx == 0 ? 0 : mx - 135, wf = int((wb >> 7) & 0xFFu), ew = wf - 127;
  bool wnz = (wb & 0x7FFFu) != 0u;
  if (m < -117 || (wnz && (wf == 0 || m + ew < -103 || m + ew > 95))) {
    m = 0;
    *bad = 1;
  }
  *reinterpret_cast<float*>(ms) = __int_as_float((127 - m) << 23);
  float wv = __uint_as_float(wb << 16) * __int_as_float((127 + m) << 23);  // exact: a bf16 where not bad
  *reinterpret_cast<unsigned short*>(ws8) = static_cast<unsigned short>(__float_as_uint(wv) >> 16);
  int lo = -110 - m, hi = 101 - m;
  if (wnz) {
    lo = max(lo, -103 - m - ew);
    hi = min(hi, 95 - m - ew);
  }
  atomicMax(lim, lo + 122);
  atomicMin(lim + 1, hi + 122);
}

// The address p as an integer (a running address the walk steps by a tile's bytes).
__device__ __forceinline__ unsigned long long dsv41c_addr(const void* p) {
  return reinterpret_cast<unsigned long long>(p);
}

// Stores the bf16 value v (a float that bf16 holds exactly: its top half) at the global address p.
__device__ __forceinline__ void dsv41c_st_bf16(unsigned long long p, float v) {
  const unsigned short h = static_cast<unsigned short>(__float_as_uint(v) >> 16);
  asm volatile("st.global.b16 [%0], %1;" : : "l"(p), "h"(h) : "memory");
}

// The walk of the dense builds with the keys in registers keeps four running addresses a thread
// (its first unit's codes and scale byte in the next tile, its score and block max in this one),
// set once from the CTA's range and stepped a tile each trip.  TileLang's own per-unit index
// arithmetic is 64-bit and, at the register limit, recomputed each tile, mostly on the integer ALU
// pipe that bounds the scoring: about 106 instructions a tile and warp for the loads and 62 for
// the score stores' epilogue, against about 41 and 35 this way (SASS loop 1335 -> 1219).  On an
// H200 at batch 32, 256K: 272.6 -> 242.5 us in a CUDA graph (BENCHMARKS.md).
//
// Pass mt's two units of this thread, rows r and r + 8 of the pass's 64 keys (r < 56), one scale
// block (its byte into an int): code bytes at cp + mt * 4096 and + 512 (64 bytes a key), scale
// bytes at sp + mt * 256 and + 32 (4 a key), where cp and sp are the thread's first unit of the
// tile (immediate offsets, no address arithmetic).  Rows from `left` on (past the visible keys)
// are not read: zero codes and scale byte z; where the whole pass is in range (a uniform test) no
// thread tests its rows.
__device__ __forceinline__ void dsv41c_load_pass(unsigned long long cp, unsigned long long sp, int mt, int left, int r,
                                                 unsigned z, void* cl, void* sl) {
  const uint4* c = reinterpret_cast<const uint4*>(cp) + mt * 256;
  const unsigned char* s = reinterpret_cast<const unsigned char*>(sp) + mt * 256;
  uint4* o = reinterpret_cast<uint4*>(cl);
  int* so = reinterpret_cast<int*>(sl);
  if (left >= 64) {
    o[0] = __ldg(c);
    o[1] = __ldg(c + 32);
    so[0] = __ldg(s);
    so[1] = __ldg(s + 32);
  } else {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    o[0] = r < left ? __ldg(c) : zero;
    o[1] = r + 8 < left ? __ldg(c + 32) : zero;
    so[0] = r < left ? static_cast<int>(__ldg(s)) : static_cast<int>(z);
    so[1] = r + 8 < left ? static_cast<int>(__ldg(s + 32)) : static_cast<int>(z);
  }
}

// -inf into the scores p[0 .. min(left, 8)): one 16-byte store where all 8 are in the row and p is
// aligned (each lane then writes whole sectors, not 2 bytes of one per store), else one at a time.
__device__ __forceinline__ void dsv41c_fill_neg_inf8(void* p, int left) {
  if (left >= 8 && (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
    *reinterpret_cast<uint4*>(p) = make_uint4(0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u, 0xFF80FF80u);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (e < left) reinterpret_cast<unsigned short*>(p)[e] = 0xFF80u;
    }
  }
}
"""


def _qperm(c):
    """The key dim whose decoded value lands in operand column c (see _DECODE_PRELUDE)."""
    return c // 8 * 8 + c % 8 // 2 + c % 2 * 4


def _qperm_regs(c):
    """The same for the register A fragment (`dsv41c_decode_frag`, d = 128): column c = 16 ki +
    8 f + 2 lane + e of a wgmma m64k16 fragment holds, for the thread of lane % 4 = `lane`, word
    r = 2 ki + f of its scale block's decode, half e: dim 32 lane + 8 (r // 4) + r % 4 + 4 e."""
    ki, f, lane, e = c // 16, c % 16 // 8, c % 8 // 2, c % 2
    r = 2 * ki + f
    return 32 * lane + 8 * (r // 4) + r % 4 + 4 * e


def _qperm8(c):
    """The key dim in operand column c of the E4M3 register A fragment (`dsv41c_decode_frag8`, d =
    128): k step q = c // 32, half f, 4-byte group t = the decoding thread's lane % 4 (its scale
    block), byte e: dim 32 t + 8 q + 4 f + e."""
    q, f, t, e = c // 32, c % 32 // 16, c % 16 // 4, c % 4
    return 32 * t + 8 * q + 4 * f + e


def _frag_a8(i, c):
    """(thread, element) of row i, column c of a 64-row wgmma m64k32 8-bit register A fragment (one
    warpgroup): the hardware's layout, which `dsv41c_decode_frag8` fills (4 bytes a register)."""
    return (i // 16 * 32 + i % 8 * 4 + c % 16 // 4,
            c // 32 * 16 + c % 32 // 16 * 8 + i % 16 // 8 * 4 + c % 4)


def _frag_a(i, c):
    """(thread, element) of row i, column c of a 64-row wgmma m64k16 register A fragment (one
    warpgroup): the hardware's layout, which `dsv41c_decode_frag` fills and the scoring annotates."""
    return i // 16 * 32 + i % 8 * 4 + c % 8 // 2, c // 16 * 8 + c % 16 // 8 * 4 + i % 16 // 8 * 2 + c % 2


def cuda_tiles_per_cta(n: int, rows: int, slots: int | None = None) -> int:
    """Key tiles each scoring CTA walks: the fewest that fit all CTAs in one wave of `slots`
    (default `_CTAS_PER_SM` per SM of an H200's 132), at most `_MAX_TPC`; a longer walk loads the
    query once for more keys, and every tile after the first has its key bytes in flight during
    the previous tile's decode, GEMM and epilogue."""
    slots = _CTAS_PER_SM * 132 if slots is None else slots
    tiles = -(-n // _BN)
    return max(1, min(_MAX_TPC, tiles, -(-tiles * rows // slots)))


def _fragment(shape, frag):
    """A TileLang fragment layout from `frag(i, c)` -> (thread, element), such as `_frag_a`."""
    return T.Fragment(shape, forward_thread_fn=lambda i, c: frag(i, c)[0], forward_index_fn=lambda i, c: frag(i, c)[1])


def _pow2(e):
    """2^e as a float32, for an int32 e in -126 .. 127 (its bits)."""
    return T.reinterpret(T.shift_left(e + 127, 23), "float32")


def _cuda_scores_prim_func(H, d, visible, cand, bmax):
    """Scores on the tensor cores; grid (S, key ranges, B) (S first: a long prefill passes the
    65535 limit of the other grid dims), `_THREADS` threads (one warpgroup at the default).

    A CTA loads its query's H x d bf16 (columns permuted as the decode stores the keys) and its H
    weights once, then walks its range of `tpc` tiles of `_BN` keys.  With candidate blocks it
    first compacts the range's kept blocks into a shared list (warp ballots, one shared atomic
    per warp for its slots; the list's order does not matter: each key's score is its own row
    of the GEMM), writes -inf for the keys (and block maxima) of the others (a 16-byte store a
    block where the row allows it: `dsv41c_fill_neg_inf8`), and walks only ceil(kept / (_BN / 8))
    tiles, each gathering _BN / 8 listed blocks.  So a Reindex layer reads and decodes only its
    candidate blocks' keys; a range with every block kept costs what it does without candidates.
    Per tile:
    - key bytes: thread t owns d/32 (key, scale block) units, so that one warp-wide 16-byte load
      reads 512 contiguous bytes (at d = 128: 8 keys, one candidate block).  With the keys in
      registers (`_KEYS_IN_REGS`, d = 128, one warpgroup) the units are the rows of the thread's
      wgmma A fragment: rows 64 mt + 16 warp + 8 h + lane / 4, scale block lane % 4.  The next
      tile's units are loaded into registers before this tile's GEMM, so the loads travel during
      the GEMM and the epilogue.  Keys whose score is -inf anyway (past the visible length) are
      not read (zeros instead); a tile without any needed key skips the decode and the GEMM (the
      flag is CTA-uniform).
    - decode (`_DECODE_PRELUDE`): the E2M1 codes times the UE8M0 scale, exact.  With the keys in
      registers, straight into the register A fragment of an m64 GEMM (`dsv41c_decode_frag`; the
      tile is two passes of 64 keys, so half the fragment is live at a time), the query's columns
      permuted to match (`_qperm_regs`).  Otherwise into one shared [_BN, d] bf16 operand tile
      (16-byte stores; the 8 lanes of a quarter warp write 8 different rows of the 128-byte
      swizzle: no bank conflicts), behind a barrier.
    - the GEMM [keys x d] x [d x H] (wgmma, fp32 accumulation).
    - E4M3 keys (`fp8_scoring`, `_FP8_KEYS`): the CTA first finds each head's power of two
      (`dsv41c_fp8_head`, one thread per head and scale block), writes the E4M3 query tile and
      checks it exact.  Each tile's threads then vote on their keys (the quad's least scale byte
      by two shuffles, the spread, the window); a failing query or key sets a shared flag that
      sends the CTA to the bf16 path from that tile on.  On the E4M3 path the keys go through
      `dsv41c_decode_frag8` into an m64k32 E4M3 fragment and one GEMM; on the bf16 path through
      `dsv41c_decode_frag_half`, a k half at a time, into two GEMMs of k 64.  2^(min_s - 122)
      (1 on the bf16 path) multiplies each key's head sum.
    - epilogue on the accumulator: round to bf16, relu, times w, round to bf16 (§6.5(d)); the sum
      over the H heads, in fp32, rounded once: a second wgmma of those products (in registers)
      against ones (`_HEAD_SUM_MMA`), or each thread's own columns, then across the 4 lanes of a
      row.  One thread per key then applies the visibility mask, stores the score, and takes the
      block max over 8 keys (8 consecutive rows: one block) by three xor shuffles.
    """
    assert _BN == _THREADS, "one thread per key of a tile in the epilogue"
    if H % 8 or H > 256 or d not in (32, 64, 128, 256):
        raise ValueError(f"index_scores: the CUDA build needs H a multiple of 8 (at most 256) and d in "
                         f"32/64/128/256, got H={H}, d={d}")
    B, S, N, NC, NB = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("NC"), T.dynamic("NB")
    nsb = d // 32
    rows_per_warp = 32 // nsb  # keys one warp-wide load covers
    units = _BN * nsb // _THREADS  # (key, scale block) units per thread and tile
    warps = _THREADS // 32
    tile_blocks = _BN // BLOCK
    # the wgmma's k steps are 16 heads; with two warpgroups TileLang lays the first GEMM's
    # accumulator and the second's register operand out on different threads (it refuses the build)
    mma_sum = bool(_HEAD_SUM_MMA) and H % 16 == 0 and _THREADS == 128
    regs = bool(_KEYS_IN_REGS) and d == 128 and _BN == _THREADS == 128
    qperm = _qperm_regs if regs else _qperm
    # with the keys in registers, a tile is two passes of one m64 GEMM (half the fragment registers
    # live at a time), each over the units 2 mt, 2 mt + 1 (the thread's rows of m tile mt)
    gm = 64 if regs else _BN
    passes = _BN // gm
    fp8 = fp8_scoring(H, d, cand)
    # dense builds with the keys in registers walk through running addresses (see the comment at
    # `dsv41c_load_pass`); the candidate-gathering and shared-memory builds index each unit, and so
    # does the guarded build (TileLang cannot take the address of a guarded element)
    running = regs and not cand and bool(_UNGUARDED)
    neg_inf = T.float32(-T.infinity("float32"))

    def row_key(LS, bx, tpc, it, r, nc):
        """(key, listed) of row r of the CTA's tile it: the range's tile it, or with candidates the
        r // 8-th block of the tile's share of the list (listed: that entry exists)."""
        if cand:
            j = it * tile_blocks + r // BLOCK
            blk = bx * tpc * tile_blocks + T.Cast("int32", LS[T.min(j, _MAX_TPC * tile_blocks - 1)])
            return blk * BLOCK + r % BLOCK, j < nc
        return (bx * tpc + it) * _BN + r, T.bool(True)

    def unit_key(tx, u):
        """(key row within the tile, scale block) of thread tx's unit u; with the keys in registers,
        unit u = 2 mt + h is row h of the thread's pair in m tile mt, scale block lane % 4 (the rows
        and columns of its wgmma A fragment)."""
        lane = tx % 32
        if regs:
            return u // 2 * 64 + tx // 32 * 16 + u % 2 * 8 + lane // 4, lane % 4
        return (u * warps + tx // 32) * rows_per_warp + lane % rows_per_warp, lane // rows_per_warp

    def scale_ok(v):
        """A scale byte v (int32 on the running addresses' walk, else uint8) at most 252."""
        return T.Cast("int32", v) <= 252 if running else v <= T.uint8(252)

    @T.macro
    def load(CODES, SCALES, LS, cl, sl, b, bx, tpc, it, nc, lim, tx, mt, kp):
        """The code bytes (16-byte loads) and scale bytes of the CTA's tile it: the units of pass mt."""
        if running:  # the pass's two units from the walk's running addresses kp
            r, _ = unit_key(tx, 2 * mt)
            T.call_extern("handle", "dsv41c_load_pass", kp[0], kp[1], mt, lim - (bx * tpc + it) * _BN - mt * 64,
                          r - mt * 64, 127 if fp8 else 0, T.address_of(cl[2 * mt, 0]), T.address_of(sl[2 * mt]))
        else:
            for uu in T.unroll(units // passes):
                u = mt * (units // passes) + uu
                r, j = unit_key(tx, u)
                t, listed = row_key(LS, bx, tpc, it, r, nc)
                if T.And(listed, t < lim):
                    for e in T.vectorized(16):
                        cl[u, e] = CODES[b, t, j * 16 + e]
                    sl[u] = SCALES[b, t, j]
                else:
                    for e in T.vectorized(16):
                        cl[u, e] = T.uint8(0)
                    sl[u] = T.uint8(127 if fp8 else 0)  # zero codes: 0 at any scale; 127 passes the E4M3 test

    @T.prim_func
    def main(Q: T.Tensor((B, S, H, d), "bfloat16"), CODES: T.Tensor((B, NC, d // 2), "uint8"),
             SCALES: T.Tensor((B, NC, nsb), "uint8"), W: T.Tensor((B, S, H), "bfloat16"),
             VL: T.Tensor((S,) if visible else (1,), "int32"),
             CAND: T.Tensor((B, S, NB) if cand else (1,), "uint8"),
             SC: T.Tensor((B, S, N), "bfloat16"), BM: T.Tensor((B, S, NB) if bmax else (1,), "bfloat16"),
             tpc: T.int32):
        with T.Kernel(S, T.ceildiv(N, _BN * tpc), B, threads=_THREADS, prelude=_DECODE_PRELUDE) as (s, bx, b):
            T.annotate_min_blocks_per_sm(_CTAS_PER_SM)  # the plan's CTAs per SM, in the register budget
            tx = T.get_thread_binding()
            if fp8:  # the two k halves of the bf16 path's operands (its GEMM in two)
                Qs = T.alloc_shared((H, d // 2), "bfloat16")
                Qs1 = T.alloc_shared((H, d // 2), "bfloat16")
            else:
                Qs = T.alloc_shared((H, d), "bfloat16")
            if regs:  # the wgmma m64k16 register A layout, which dsv41c_decode_frag fills by hand
                ka = d // 2 if fp8 else d
                As = T.alloc_fragment((gm, ka), "bfloat16")
                T.annotate_layout({As: _fragment((gm, ka), _frag_a)})
            else:
                As = T.alloc_shared((_BN, d), "bfloat16")
            Ws = T.alloc_shared((H,), "bfloat16")
            Rs = T.alloc_shared((_BN,), "float32")
            LS = T.alloc_shared((_MAX_TPC * tile_blocks if cand else 1,), "uint16")  # kept blocks, range offsets
            cnt = T.alloc_shared((1,), "int32")
            acc = T.alloc_fragment((gm, H), "float32")
            if mma_sum:
                prod = T.alloc_fragment((gm, H), "bfloat16")
                ones = T.alloc_shared((8, H), "bfloat16")
                hsum = T.alloc_fragment((gm, 8), "float32")
            else:
                rsum = T.alloc_fragment((gm,), "float32")
            if fp8:
                Qs8 = T.alloc_shared((H, d), "float8_e4m3fn")
                As8 = T.alloc_fragment((gm, d), "float8_e4m3fn")
                T.annotate_layout({As8: _fragment((gm, d), _frag_a8)})
                Ws8 = T.alloc_shared((H,), "bfloat16")  # w x 2^m_h
                MS = T.alloc_shared((H,), "float32")  # 2^-m_h
                KS = T.alloc_shared((_BN,), "float32")  # the tile's keys' 2^(min_s - 122), 1 on the bf16 path
                LIM = T.alloc_shared((2,), "int32")  # the window of min_s the query allows
                BAD = T.alloc_shared((1,), "int32")  # sticky: the bf16 path from here on
                mnl = T.alloc_local((units,), "int32")
                mnlo = T.alloc_var("int32")
                mnhi = T.alloc_var("int32")
                fast = T.alloc_var("int32")
                okv = T.alloc_var("int32")
                mx = T.alloc_var("int32")
            cl = T.alloc_local((units, 16), "uint8")
            # the running addresses: the next tile's key bytes (codes, scales), this tile's score and block max
            kp = T.alloc_local((4,), "uint64") if running else None
            sl = T.alloc_local((units,), "int32" if running else "uint8")  # (int32: no masks of its bytes)
            if not regs:
                al = T.alloc_local((32,), "bfloat16")  # one decoded unit, on its way to As
            sv = T.alloc_var("float32")
            live = T.alloc_var("int32")
            nc = T.alloc_var("int32")
            walk = T.alloc_var("int32")
            base = T.alloc_var("int32")
            if fp8:
                for h, c in T.Parallel(H, d // 2):
                    Qs[h, c] = Q[b, s, h, qperm(c)]
                    Qs1[h, c] = Q[b, s, h, qperm(d // 2 + c)]
            else:
                for h, c in T.Parallel(H, d):
                    Qs[h, c] = Q[b, s, h, qperm(c)]
            for h in T.Parallel(H):
                Ws[h] = W[b, s, h]
            if mma_sum:
                for j, h in T.Parallel(8, H):
                    ones[j, h] = T.bfloat16(1)
            if fp8:
                if tx == 0:
                    LIM[0] = 2  # every block's E2M1 x 2^(s - 127) a normal number (no subnormal key)
                    LIM[1] = 249  # 2^(min_s - 122) a normal float
                    BAD[0] = 0
                T.sync_threads()
                # per head (the 4 threads of item 4h .. 4h + 3, one scale block each): m_h from the
                # largest exponent field, then w' and the window of min_s (`_FP8_KEYS`)
                for k in T.unroll(-(-H * 4 // _THREADS)):
                    item = k * _THREADS + tx
                    mx = 0
                    if item < H * 4:
                        mx = T.call_extern("int32", "dsv41c_max_exp32", T.address_of(Q[b, s, item // 4, item % 4 * 32]))
                    mx = T.max(mx, T.shfl_xor(mx, 1))
                    mx = T.max(mx, T.shfl_xor(mx, 2))
                    if T.And(item < H * 4, item % 4 == 0):
                        T.call_extern("handle", "dsv41c_fp8_head", mx, T.address_of(W[b, s, item // 4]),
                                      T.address_of(Ws8[item // 4]), T.address_of(MS[item // 4]),
                                      T.address_of(LIM[0]), T.address_of(BAD[0]))
                T.sync_threads()  # MS written
                for h, c in T.Parallel(H, d):
                    Qs8[h, c] = T.Cast("float8_e4m3fn", T.Cast("float32", Q[b, s, h, _qperm8(c)]) * MS[h])
                    if T.Or(T.Cast("float32", T.Cast("float8_e4m3fn", T.Cast("float32", Q[b, s, h, _qperm8(c)]) * MS[h]))
                            != T.Cast("float32", Q[b, s, h, _qperm8(c)]) * MS[h],
                            T.And(T.Cast("float32", Q[b, s, h, _qperm8(c)]) * MS[h] == T.float32(0),
                                  T.Cast("float32", Q[b, s, h, _qperm8(c)]) != T.float32(0))):
                        BAD[0] = 1
                T.sync_threads()
                mnlo = LIM[0]
                mnhi = LIM[1]
            lim = T.min(N, VL[s]) if visible else N
            nc = 0
            walk = tpc
            if cand:
                if tx == 0:
                    cnt[0] = 0
                T.sync_threads()
                for k in T.unroll(-(-_MAX_TPC * tile_blocks // _THREADS)):
                    o = k * _THREADS + tx
                    blk = bx * tpc * tile_blocks + o
                    inr = T.And(o < tpc * tile_blocks, blk < NB)
                    keep = T.And(inr, CAND[b, s, T.min(blk, NB - 1)] != T.uint8(0))
                    # append o to the list where kept: one shared atomic per warp for its slots
                    m = T.call_extern("uint32", "__ballot_sync", _u(0xFFFFFFFF), T.Cast("int32", keep))
                    if m != _u(0):
                        leader = T.call_extern("int32", "__ffs", m) - 1
                        base = 0
                        if tx % 32 == leader:
                            base = T.atomic_add(cnt[0], T.call_extern("int32", "__popc", m), return_prev=True)
                        base = T.call_extern("int32", "__shfl_sync", _u(0xFFFFFFFF), base, leader)
                        if keep:
                            below = m & ((_u(1) << T.Cast("uint32", tx % 32)) - _u(1))
                            LS[base + T.call_extern("int32", "__popc", below)] = T.Cast("uint16", o)
                    if T.And(inr, T.Not(keep)):
                        T.call_extern("handle", "dsv41c_fill_neg_inf8", T.address_of(SC[b, s, blk * BLOCK]),
                                      N - blk * BLOCK)
                        if bmax:
                            BM[b, s, blk] = T.Cast("bfloat16", neg_inf)
                T.sync_threads()
                nc = cnt[0]
                walk = T.ceildiv(nc, tile_blocks)
            if running:  # the thread's first unit of the walk's first tile (codes, scale byte), its score, block max
                r0, j0 = unit_key(tx, 0)
                kp[0] = T.call_extern("uint64", "dsv41c_addr", T.address_of(CODES[b, bx * tpc * _BN + r0, j0 * 16]))
                kp[1] = T.call_extern("uint64", "dsv41c_addr", T.address_of(SCALES[b, bx * tpc * _BN + r0, j0]))
                kp[2] = T.call_extern("uint64", "dsv41c_addr", T.address_of(SC[b, s, bx * tpc * _BN + tx]))
                if bmax:
                    kp[3] = T.call_extern("uint64", "dsv41c_addr",
                                          T.address_of(BM[b, s, bx * tpc * tile_blocks + tx // BLOCK]))
            for mt in T.unroll(passes):
                load(CODES, SCALES, LS, cl, sl, b, bx, tpc, 0, nc, lim, tx, mt, kp)
            if running:  # from here on kp is the next tile's (the loads run a tile ahead)
                kp[0] = kp[0] + T.uint64(_BN * d // 2)
                kp[1] = kp[1] + T.uint64(_BN * nsb)
            for it in T.serial(walk):
                t, listed = row_key(LS, bx, tpc, it, tx, nc)  # this thread's key in the epilogue
                if fp8:  # the tile's keys on the E4M3 path? (each thread its units; a warp vote)
                    okv = 1
                    for u in T.unroll(units):
                        mnl[u] = T.Cast("int32", sl[u])
                        mnl[u] = T.min(mnl[u], T.shfl_xor(mnl[u], 1))
                        mnl[u] = T.min(mnl[u], T.shfl_xor(mnl[u], 2))
                        # (a scale byte above 252 makes the ref's bf16 key inf or NaN: the bf16 path)
                        okv = T.Select(T.And(T.And(T.Cast("int32", sl[u]) - mnl[u] <= 11, scale_ok(sl[u])),
                                             T.And(mnl[u] >= mnlo, mnl[u] <= mnhi)), okv, 0)
                    if T.call_extern("int32", "__any_sync", _u(0xFFFFFFFF), T.Cast("int32", okv == 0)) != 0:
                        if tx % 32 == 0:
                            BAD[0] = 1
                # (a barrier: the previous tile's readers of As and Rs are done)
                live = T.call_extern("int32", "__syncthreads_or", T.Cast("int32", T.And(listed, t < lim)))
                if fp8:
                    fast = T.Cast("int32", BAD[0] == 0)  # read before the epilogue's barrier: uniform
                for mt in T.unroll(passes):
                    if live != 0:
                        if fp8:
                            for h2 in T.unroll(2):
                                u = 2 * mt + h2
                                r, _ = unit_key(tx, u)
                                if fast != 0:  # (the bf16 path decodes a k half at a time, at its GEMMs)
                                    T.call_extern("handle", "dsv41c_decode_frag8", T.address_of(cl[u, 0]),
                                                  T.Cast("uint32", T.Cast("int32", sl[u]) - mnl[u]), T.address_of(As8[0, 0]), h2)
                                if tx % 4 == 0:
                                    KS[r] = T.Select(fast != 0, _pow2(mnl[u] - 122),
                                                     T.float32(1))
                        elif regs:
                            for h2 in T.unroll(2):
                                T.call_extern("handle", "dsv41c_decode_frag", T.address_of(cl[2 * mt + h2, 0]),
                                              T.Cast("uint32", sl[2 * mt + h2]), T.address_of(As[0, 0]), h2)
                        else:
                            for u in T.unroll(units):
                                r, j = unit_key(tx, u)
                                T.call_extern("handle", "dsv41c_decode_block", T.address_of(cl[u, 0]),
                                              T.Cast("uint32", sl[u]), T.address_of(al[0]))
                                for q in T.unroll(4):
                                    for e in T.vectorized(8):
                                        As[r, j * 32 + q * 8 + e] = al[q * 8 + e]
                    if it + 1 < walk:  # the next tile's bytes travel during this tile's GEMM
                        if fp8:  # (the bf16 path's decode reads this pass's bytes after its first GEMM)
                            if fast != 0:
                                load(CODES, SCALES, LS, cl, sl, b, bx, tpc, it + 1, nc, lim, tx, mt, kp)
                        else:
                            load(CODES, SCALES, LS, cl, sl, b, bx, tpc, it + 1, nc, lim, tx, mt, kp)
                    if not regs:
                        T.sync_threads()  # As is written
                    if live != 0:
                        # the GEMM, then with the head sum on the tensor cores the bf16 products (rounded
                        # once: the ref's bf16(relu(bf16(s)) * w)), summed over heads in fp32 (x 1 exact)
                        if fp8:
                            if fast != 0:
                                T.gemm(As8, Qs8, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                                for i, h in T.Parallel(gm, H):
                                    prod[i, h] = T.max(T.Cast("bfloat16", acc[i, h]), T.bfloat16(0)) * Ws8[h]
                            else:  # decoded here, a k half at a time; the next tile's bytes after
                                for h2 in T.unroll(2):
                                    T.call_extern("handle", "dsv41c_decode_frag_half", T.address_of(cl[2 * mt + h2, 0]),
                                                  T.Cast("uint32", sl[2 * mt + h2]), T.address_of(As[0, 0]), h2)
                                T.gemm(As, Qs, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                                for h2 in T.unroll(2):
                                    T.call_extern("handle", "dsv41c_decode_frag_half", T.address_of(cl[2 * mt + h2, 8]),
                                                  T.Cast("uint32", sl[2 * mt + h2]), T.address_of(As[0, 0]), h2)
                                T.gemm(As, Qs1, acc, transpose_B=True, clear_accum=False, policy=T.GemmWarpPolicy.FullRow)
                                if it + 1 < walk:
                                    load(CODES, SCALES, LS, cl, sl, b, bx, tpc, it + 1, nc, lim, tx, mt, kp)
                                for i, h in T.Parallel(gm, H):
                                    prod[i, h] = T.max(T.Cast("bfloat16", acc[i, h]), T.bfloat16(0)) * Ws[h]
                                if _FP8_POISON_BF16_PATH:  # (tests: which tiles took this path)
                                    for i, h in T.Parallel(gm, H):
                                        prod[i, h] = T.Cast("bfloat16", T.float32(float("nan")))
                        else:
                            T.gemm(As, Qs, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                            if mma_sum:
                                for i, h in T.Parallel(gm, H):
                                    prod[i, h] = T.max(T.Cast("bfloat16", acc[i, h]), T.bfloat16(0)) * Ws[h]
                        if mma_sum:
                            T.gemm(prod, ones, hsum, transpose_B=True, clear_accum=True,
                                   policy=T.GemmWarpPolicy.FullRow)
                            for i, j in T.Parallel(gm, 8):
                                if j == 0:  # the 8 columns are equal
                                    Rs[mt * gm + i] = hsum[i, j]
                        else:
                            for i, h in T.Parallel(gm, H):
                                # on bf16 pairs: the product of two bf16 is exact in fp32, so rounding it
                                # once to bf16 is the ref's bf16(relu(bf16(s)) * w)
                                acc[i, h] = T.Cast("float32", T.max(T.Cast("bfloat16", acc[i, h]), T.bfloat16(0)) * Ws[h])
                            T.reduce_sum(acc, rsum, dim=1)
                            for i in T.Parallel(gm):
                                Rs[mt * gm + i] = rsum[i]
                if running:
                    kp[0] = kp[0] + T.uint64(_BN * d // 2)
                    kp[1] = kp[1] + T.uint64(_BN * nsb)
                T.sync_threads()
                # (a skipped tile reads stale sums here; every one of its scores is masked below)
                sv = T.Cast("float32", T.Cast("bfloat16", Rs[tx] * KS[tx] if fp8 else Rs[tx]))
                sv = T.Select(sv == T.float32(0), T.float32(0), sv)  # -0 -> +0
                if visible:
                    sv = T.Select(t >= VL[s], neg_inf, sv)
                if T.And(listed, t < N):
                    if running:  # (sv is a bf16 value: its top half is the score)
                        T.call_extern("handle", "dsv41c_st_bf16", kp[2], sv)
                    else:
                        SC[b, s, t] = T.Cast("bfloat16", sv)
                if bmax:
                    sv = T.Select(T.And(listed, t < N), sv, neg_inf)
                    for k in T.unroll(3):
                        sv = T.max(sv, T.shfl_xor(sv, 1 << k))
                    if T.And(T.And(listed, t < N), tx % BLOCK == 0):
                        if running:
                            T.call_extern("handle", "dsv41c_st_bf16", kp[3], sv)
                        else:
                            BM[b, s, t // BLOCK] = T.Cast("bfloat16", sv)
                if running:  # the next tile's score and block max
                    kp[2] = kp[2] + T.uint64(_BN * 2)
                    if bmax:
                        kp[3] = kp[3] + T.uint64(tile_blocks * 2)
    main = main.with_attr(NO_SYNC_ATTR, 1)  # its own barriers (TileLang's pass would add a redundant one)
    return main.with_attr(NO_GUARD_ATTR, 1) if _UNGUARDED else main

_SEL_THREADS = 256  # CUDA select: threads per CTA, one histogram bin each
_SEL_VEC = 8  # CUDA select: consecutive scores per thread and chunk (a multiple of 8: 16-byte loads)
_SEL_CTAS_PER_SM = 4  # CUDA select: the split's CTAs per SM (`cuda_select_split`), and the launch bounds' minimum
_SEL_GATHER_CHUNKS = 3  # CUDA select: the fewest chunks a part spans for the candidate mode (`cuda_select_gathers`)
# CUDA select, candidate mode: built without TileLang's bounds guards (NO_GUARD_ATTR), every global
# access in range by construction or guarded here: the flags by the window (blk < pb0 + pbn <=
# ceil(N / 8) = NB: `_topk_impl` checks the flags' shape); the score loads at
# min(i, N - 1) (n > k >= 1); PART at parts q < p and bins ctl[2] (+ 1) of find_bin; the output
# slots by an explicit < KO.  On an H200 at batch 32, 256K, side by side: Reindex 62.7 -> 61.3 us,
# score+topk 348.0 -> 346.4 us (BENCHMARKS.md).
_SEL_UNGUARDED = 1
SELECT_PHASES = ("hist0", "hist1", "emit")

# The select's key loads: 8 consecutive bf16 scores as one 16-byte load where they are whole and
# aligned (a row of n % 8 == 0 scores), else one at a time; zeros past the row.
_FETCH_PRELUDE = r"""
__device__ __forceinline__ void dsv41c_fetch8(const unsigned short* p, int left, unsigned short* out) {
  if (left >= 8 && (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
    *reinterpret_cast<uint4*>(out) = __ldg(reinterpret_cast<const uint4*>(p));
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = e < left ? p[e] : (unsigned short)0;
  }
}
"""


def cuda_select_split(n: int, rows: int, slots: int | None = None) -> tuple[int, int]:
    """(parts P, scores per part) of each row for the CUDA select: about `slots` CTAs in all
    (default `_SEL_CTAS_PER_SM` per SM of an H200's 132), each part a whole number of chunks."""
    slots = _SEL_CTAS_PER_SM * 132 if slots is None else slots
    chunks = max(1, -(-n // (_SEL_THREADS * _SEL_VEC)))
    per = -(-chunks // max(1, min(chunks, -(-slots // rows))))
    return -(-chunks // per), per * _SEL_THREADS * _SEL_VEC


def cuda_select_gathers(part: int) -> bool:
    """Whether the CUDA top-k given candidate flags walks lists of the kept blocks ("cand" mode)
    for parts of `part` scores, rather than every score.  The lists cost a flag pass and a block
    scan per window before the first score load, about one step of the dense walk: timed on an
    H200 (Reindex rows keeping 2048 random blocks), parts of 1 chunk lost 4 us a top-k, 2 chunks
    tied, 8 chunks won 35 us (62 -> 27 us at batch 32, 256K)."""
    return part >= _SEL_GATHER_CHUNKS * _SEL_THREADS * _SEL_VEC


def _cuda_select_prim_func(mode, phase, block=BLOCK):
    """One phase of the CUDA select; grid (S, P parts of the row, B), 256 threads.

    hist0  each CTA counts the high bytes of its part's keys into 256 shared bins (warp-aggregated:
           `__match_any_sync` groups the lanes with equal bins, one shared atomic per group) and
           adds them to the row's global histogram HIST[b, s, 0] (zeroed by the caller).
    hist1  every CTA finds the threshold bin b1 from HIST[b, s, 0] (a block scan over the bins from
           the top, one bin per thread) and counts the low bytes of its keys in b1 into HIST[b, s, 1];
           it also writes, for l = 0..256, its part's keys above b1 plus its keys in b1 with low
           byte >= l to PART[b, s, p, l] (a block scan of its bins from the top), so no extra
           pass over the keys is needed for each part's share of the keys > T and == T.
    emit   every CTA finds T = (b1, b2) and need = k - #(keys > T), sums from PART the keys > T
           and == T of the parts before it, then walks its part in chunks of `_SEL_THREADS x
           _SEL_VEC` scores, `_SEL_VEC` consecutive per thread (their loads one chunk ahead): a
           block scan of the per-thread (> T, == T) counts (16 bits each in one int32) gives each
           thread its output positions; the output is in index order.  Funnel mode writes every
           block's keep flag instead.

    Candidate mode ("cand": top-k given the block flags, every score outside the kept blocks
    -inf) walks lists instead of the whole part: per window of `_SEL_THREADS x 8` blocks, each
    thread reads 8 flags, a block scan places its kept blocks in a shared list in ascending
    order, and each step gives a thread one listed block (its 8 scores, one 16-byte load).  The
    histogram phases add the blocks not kept as -inf keys in bulk, so HIST and PART count the
    whole row; the emit walks the lists while T is above -inf, and every score of its part when
    T is -inf (fewer than k finite scores: the -inf fill takes -inf keys in index order).
    """
    B, S, N, KO, P = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("KO"), T.dynamic("P")
    CB, CS, NB = T.dynamic("CB"), T.dynamic("CS"), T.dynamic("NB")  # CAND: [B, S, nb] in mode "cand", else unread
    blocks, cand = mode == "blocks", mode == "cand"
    out_shape, out_dtype = ((B, S, N), "uint8") if blocks else ((B, S, KO), "int32")
    ts, vec = _SEL_THREADS, _SEL_VEC
    win = ts * BLOCK  # cand: the blocks one list covers (8 flags a thread)
    if cand and vec != BLOCK:
        raise ValueError(f"indexer select: candidate mode needs _SEL_VEC = {BLOCK} (a block a thread), got {vec}")
    chunk = ts * vec
    warps = ts // 32
    level = 0 if phase == "hist0" else 1

    @T.macro
    def block_scan(val, res, wsum, tx):
        """res[0] = inclusive scan of val over the CTA's threads, res[1] = the CTA total."""
        res[0] = val
        for k in T.unroll(5):
            res[2] = T.shfl_up(res[0], 1 << k)
            if tx % 32 >= (1 << k):
                res[0] = res[0] + res[2]
        if tx % 32 == 31:
            wsum[tx // 32] = res[0]
        T.sync_threads()
        res[1] = 0
        for w in T.serial(warps):
            if w < tx // 32:
                res[0] = res[0] + wsum[w]
            res[1] = res[1] + wsum[w]
        T.sync_threads()

    @T.macro
    def find_bin(HIST, b, s, lvl, want, ctl, res, wsum, tx):
        """ctl[2 lvl] = the bin holding the want-th largest key of level lvl's histogram,
        ctl[2 lvl + 1] = the keys in higher bins (want >= 1)."""
        block_scan(HIST[b, s, lvl, 255 - tx], res, wsum, tx)
        if res[0] >= want and res[0] - HIST[b, s, lvl, 255 - tx] < want:
            ctl[2 * lvl] = 255 - tx
            ctl[2 * lvl + 1] = res[0] - HIST[b, s, lvl, 255 - tx]
        T.sync_threads()

    @T.macro
    def fetch(SC, hn, b, s, i0, listed):
        """The raw bits of scores i0 .. i0 + vec - 1 into hn (zeros past the row or unlisted)."""
        for v in T.unroll(vec // 8):
            T.call_extern("handle", "dsv41c_fetch8", T.address_of(SC[b, s, T.min(i0 + v * 8, N - 1)]),
                          T.Select(listed, N - i0 - v * 8, 0), T.address_of(hn[v * 8]))

    def entry(c, gath, LS, nl, p, part, tx):
        """(first score of this thread's `vec` in step c of a walk, whether it holds keys): in a
        gathered walk the block LS[c * ts + tx] of the window's list of nl, else the part's chunk c."""
        dense = p * part + c * chunk + tx * vec
        if not cand:
            return dense, T.bool(True)
        j = c * ts + tx
        return T.Select(gath != 0, LS[T.min(j, T.max(nl - 1, 0))] * BLOCK, dense), T.Or(gath == 0, j < nl)

    def steps(gath, nl, part):
        """Steps of a window's walk: ceil(nl / ts) listed blocks, or the part's chunks."""
        return T.Select(gath != 0, T.ceildiv(nl, ts), part // chunk) if cand else part // chunk

    @T.macro
    def load_step(SC, LS, lc, hv, hn, kl, b, s, p, part, c, gath, newest, tx):
        """Keys of this thread's scores in step c from hn (fetched before), then the next step's
        bits into hn: their loads travel while this step is processed."""
        i0, listed = entry(c, gath, LS, lc[0], p, part, tx)
        for e in T.unroll(vec):
            hv[e] = hn[e]
        if c + 1 < steps(gath, lc[0], part):
            nxt, nxt_listed = entry(c + 1, gath, LS, lc[0], p, part, tx)
            fetch(SC, hn, b, s, nxt, nxt_listed)
        for e in T.unroll(vec):
            # past the row or unlisted: 0x10000, above every 16-bit key and equal to no threshold
            kl[e] = T.Select(listed and i0 + e < N, _sel_key(hv[e], i0 + e, newest, blocks), _u(0x10000))

    @T.macro
    def gather_list(CAND, LS, lc, b, s, w0, wn, res, wsum, tx):
        """LS[0 .. lc[0]) = the kept blocks among w0 .. w0 + wn - 1, ascending (8 flags a thread,
        a block scan of the counts); lc[1] += the scores of this thread's blocks not kept."""
        lc[2] = 0  # this thread's kept blocks, then its next list slot
        lc[3] = 0  # their bits
        for e in T.unroll(BLOCK):
            if tx * BLOCK + e < wn:
                if CAND[b, s, w0 + tx * BLOCK + e] != T.uint8(0):
                    lc[2] = lc[2] + 1
                    lc[3] = lc[3] | (1 << e)
                else:
                    lc[1] = lc[1] + T.min(BLOCK, N - (w0 + tx * BLOCK + e) * BLOCK)
        block_scan(lc[2], res, wsum, tx)
        lc[2] = res[0] - lc[2]
        for e in T.unroll(BLOCK):
            if (lc[3] >> e) & 1 != 0:
                LS[lc[2]] = w0 + tx * BLOCK + e
                lc[2] = lc[2] + 1
        lc[0] = res[1]
        T.sync_threads()

    @T.macro
    def open_window(SC, CAND, LS, lc, hn, b, s, p, part, wi, gath, res, wsum, tx):
        """Window wi of the part's walk: in a gathered walk its list of kept blocks (lc[0] of
        them); then the first step's bits into hn."""
        if cand:
            if gath != 0:
                pb0 = p * (part // BLOCK)  # the part's first block, and its blocks in the row
                pbn = T.min(part // BLOCK, T.ceildiv(N, BLOCK) - pb0)
                gather_list(CAND, LS, lc, b, s, pb0 + wi * win, T.min(win, pbn - wi * win), res, wsum, tx)
        i0, listed = entry(0, gath, LS, lc[0], p, part, tx)
        fetch(SC, hn, b, s, i0, listed)

    @T.prim_func
    def main(SC: T.Tensor((B, S, N), "uint16"), VL: T.Tensor((S,), "int32"),
             CAND: T.Tensor((CB, CS, NB), "uint8"), HIST: T.Tensor((B, S, 2, 256), "int32"),
             PART: T.Tensor((B, S, P, 257), "int32"), OUT: T.Tensor(out_shape, out_dtype),
             part: T.int32, k: T.int32, offset: T.int32):
        with T.Kernel(S, P, B, threads=ts, prelude=_FETCH_PRELUDE) as (s, p, b):
            T.annotate_min_blocks_per_sm(_SEL_CTAS_PER_SM)  # the split's CTAs per SM, in the register budget
            tx = T.get_thread_binding()
            hist = T.alloc_shared((256,), "int32")
            ctl = T.alloc_shared((4,), "int32")
            wsum = T.alloc_shared((warps,), "int32")
            LS = T.alloc_shared((win if cand else 1,), "int32")
            kl = T.alloc_local((vec,), "uint32")
            hv = T.alloc_local((vec,), "uint16")
            hn = T.alloc_local((vec,), "uint16")
            res = T.alloc_local((3,), "int32")
            run = T.alloc_local((2,), "int32")
            lc = T.alloc_local((4,), "int32")
            bin_ = T.alloc_var("uint32")
            peers = T.alloc_var("uint32")
            thr = T.alloc_var("uint32")
            need = T.alloc_var("int32")
            gt = T.alloc_var("int32")
            eq = T.alloc_var("int32")
            gath = T.alloc_var("int32")
            kk = k
            newest = T.Select(VL[s] > 0, (VL[s] - 1) // block, -1)  # blocks: the pinned block
            lane_below = (_u(1) << T.Cast("uint32", tx % 32)) - _u(1)
            windows = T.ceildiv(T.min(part, N - p * part), win * BLOCK)  # of a gathered walk
            if phase != "hist0":
                find_bin(HIST, b, s, 0, kk, ctl, res, wsum, tx)
            if phase == "emit":
                find_bin(HIST, b, s, 1, kk - ctl[1], ctl, res, wsum, tx)
                thr = T.Cast("uint32", ctl[0] * 256 + ctl[2])
                need = kk - ctl[1] - ctl[3]
            # a gathered walk (candidate mode) visits the kept blocks only; the emit walks every
            # score when T is -inf (the row has fewer than k finite scores: the -inf fill)
            gath = 0
            if cand:
                gath = 1 if phase != "emit" else T.Select(thr > _u(_KEY_NEG_INF), 1, 0)
            lc[0] = 0
            lc[1] = 0
            if phase == "hist0" or phase == "hist1":
                hist[tx] = 0
                gt = 0  # hist1: this thread's keys above the bin b1
                T.sync_threads()
                for wi in T.serial(windows if cand else 1):
                    open_window(SC, CAND, LS, lc, hn, b, s, p, part, wi, gath, res, wsum, tx)
                    for c in T.serial(steps(gath, lc[0], part)):
                        load_step(SC, LS, lc, hv, hn, kl, b, s, p, part, c, gath, newest, tx)
                        for e in T.unroll(vec):
                            if phase == "hist0":
                                bin_ = T.Select(kl[e] < _u(0x10000), kl[e] >> _u(8), _u(256))
                            else:
                                bin_ = T.Select(kl[e] >> _u(8) == T.Cast("uint32", ctl[0]), kl[e] & _u(0xFF), _u(256))
                                gt = gt + T.Select(kl[e] >> _u(8) > T.Cast("uint32", ctl[0]) and kl[e] < _u(0x10000),
                                                   1, 0)
                            peers = T.call_extern("uint32", "__match_any_sync", _u(0xFFFFFFFF), bin_)
                            if bin_ < _u(256) and (peers & lane_below) == _u(0):
                                T.atomic_add(hist[T.Cast("int32", bin_)], T.call_extern("int32", "__popc", peers))
                if cand:
                    # the blocks not kept hold -inf scores (key 0x007F): high byte 0, low byte 0x7F
                    if phase == "hist0":
                        if lc[1] > 0:
                            T.atomic_add(hist[0], lc[1])
                    elif lc[1] > 0 and ctl[0] == 0:
                        T.atomic_add(hist[_KEY_NEG_INF & 0xFF], lc[1])
                if phase == "hist1":
                    # PART[b, s, p, l] = this part's keys above b1 plus its keys in b1 with low byte
                    # >= l (l = 0..256): the emit reads two entries per part once it knows b2
                    block_scan(gt, res, wsum, tx)  # (its barriers also end the counting)
                    run[0] = res[1]
                    block_scan(hist[255 - tx], res, wsum, tx)
                    PART[b, s, p, 255 - tx] = run[0] + res[0]
                    if tx == 0:
                        PART[b, s, p, 256] = run[0]
                else:
                    T.sync_threads()
                if hist[tx] > 0:
                    T.atomic_add(HIST[b, s, level, tx], hist[tx])
            else:
                # keys > T and == T in the parts before this one: PART[q, b2 + 1] and
                # PART[q, b2] - PART[q, b2 + 1] of each part q < p
                for j in T.serial(2):  # run[0], run[1]: keys > T and == T before this step
                    res[2] = 0
                    for qi in T.serial(T.ceildiv(p, ts)):
                        q = qi * ts + tx
                        if q < p:
                            above = PART[b, s, q, ctl[2] + 1]
                            res[2] = res[2] + T.Select(j == 0, above, PART[b, s, q, ctl[2]] - above)
                    block_scan(res[2], res, wsum, tx)
                    run[j] = res[1]
                for wi in T.serial(T.Select(gath != 0, windows, 1) if cand else 1):
                    open_window(SC, CAND, LS, lc, hn, b, s, p, part, wi, gath, res, wsum, tx)
                    for c in T.serial(steps(gath, lc[0], part)):
                        load_step(SC, LS, lc, hv, hn, kl, b, s, p, part, c, gath, newest, tx)
                        i0, listed = entry(c, gath, LS, lc[0], p, part, tx)
                        gt = 0
                        for e in T.unroll(vec):
                            gt = gt + T.Select(kl[e] > thr and kl[e] < _u(0x10000), 1, 0) + \
                                T.Select(kl[e] == thr, 65536, 0)
                        block_scan(gt, res, wsum, tx)
                        res[0] = res[0] - gt
                        gt = run[0] + (res[0] & 0xFFFF)
                        eq = run[1] + (res[0] >> 16)
                        for e in T.unroll(vec):
                            i = i0 + e
                            if blocks:
                                if i < N:
                                    OUT[b, s, i] = T.Cast("uint8", (kl[e] > thr or (kl[e] == thr and eq < need))
                                                          and kl[e] > _u(_KEY_NEG_INF))
                            elif listed and i < N and (kl[e] > thr or (kl[e] == thr and eq < need)):
                                if gt + T.min(eq, need) < KO:  # (always: the k selected fill the k slots)
                                    OUT[b, s, gt + T.min(eq, need)] = T.Select(i >= VL[s], -1, i + offset)
                            gt = gt + T.Select(kl[e] > thr, 1, 0)
                            eq = eq + T.Select(kl[e] == thr, 1, 0)
                        run[0] = run[0] + (res[1] & 0xFFFF)
                        run[1] = run[1] + (res[1] >> 16)
    # candidate mode places its own barriers: TileLang's pass adds 3 redundant ones per window and
    # step of the histograms (the list and the bins are guarded by the block scans' barriers)
    if cand:
        main = main.with_attr(NO_SYNC_ATTR, 1)
        if _SEL_UNGUARDED:
            main = main.with_attr(NO_GUARD_ATTR, 1)
    return main
