"""Single-pass mHC (MODEL.md §4.1, §5): TileLang kernels for the stream side of every sublayer.

Ops (`torch.ops.dsv41c.*`); T tokens, m streams of width D, mix = 2m + m*m coefficients; streams
fp32 or bf16, coefficients fp32:
  mhc_pre(h, fn, scale, base, pre_delayed, *, norm_eps, hc_eps, iters)
      h [T,m,D] -> (x [T,D] = hc_collapse(h, pre_delayed), pre [T,m], post [T,m], comb [T,m,m]
                    = hc_mixes(h, fn, scale, base))
  mhc_post_pre(y, res, post, comb, pre_delayed, fn, scale, base, *, norm_eps, hc_eps, iters)
      -> (h_new [T,m,D] = hc_expand(y, res, post, comb), x = hc_collapse(h_new, pre_delayed),
          pre', post', comb' = hc_mixes(h_new, fn, scale, base))
  mhc_post_collapse(y, res, post, comb, pre_delayed) -> (h_new, x)     (no mixes)
`pre_delayed` is the *delayed* pre mix of §4.1: the previous sublayer's pre, never the one computed
from the same stream.  `mhc_pre` is a layer's first site (and the site after an Engram layer);
`mhc_post_pre` is every later site; `mhc_post_collapse` is the head's input and the step before an
Engram layer.  The torch references `*_ref` compose `dsv41c.mhc` and define the semantics.

Numerics.  The stream outputs (h_new, x) depend only on the inputs, and the kernels reproduce the
reference's fp32 arithmetic exactly: each product rounded on its own, sources added in order
i = 0..m-1 starting from the first product, post*y added last, one rounding to the stream dtype
(§5.3 [exactness]).  The CUDA build spells these with __fmul_rn/__fadd_rn, because nvcc contracts
a*b+c into an FMA by default; the C build runs at -O0 without FMA.  x and the mixes read h_new as
stored (rounded).  The mixes GEMM sums m*D terms in another order than torch, so pre/post/comb
agree to fp32 rounding, not bitwise (the tests bound the difference).

CPU (C target): one program per token, scalar loops; bf16 travels as its uint16 bits.  The mixes
sum m*DC products per block of DC columns, then the blocks in order (fp32 error ~1e-7, like torch).

CUDA (sm_90a: wgmma needs the arch-specific target).
  post_collapse: one flat streaming kernel, no shared memory, no barrier.  An item is 8 consecutive
     columns of one token; consecutive threads take consecutive items, so a warp's 16-byte accesses
     cover 512 contiguous bytes of a row.  Each thread loads its 2 items (the m streams, y and the
     token's 24 coefficients) before computing any.
  pre, post_pre: two launches.
  1. `main`: for bf16 streams with D a multiple of 256, the column-resident wgmma kernel
     (`_cuda_wg_prim_func`): each CTA keeps fn's slice for 256 columns in shared memory, split
     once into two bf16 pieces (fn to about 2^-17), as the A operand of a transposed mixes GEMM
     for every token it sees; streaming warps move the streams global -> registers -> global with
     the flat kernel's 512-byte row pieces and write h_new into a shared B tile per 16-token
     block, and a warpgroup of its own runs the block's wgmma behind them.  On an H200, in a CUDA
     graph: post_pre 67-72% / 81% of the bound at T = 4096 / 65536, pre 55-57% / 67-70%; on an
     H100 (lower bandwidth) post_pre 79% / 86%, pre 68-70% / 83-84%; T = 1 takes 11.6 / 10.1 us
     for the two launches on an H100 (13.7 / 11.9 before the finalize's programmatic launch and
     fixed K; BENCHMARKS.md).  (Removed, each timed slower: a
     register-operand mma.sync kernel with the same resident slice in three pieces, 60-61% /
     65-67% and 47-50% / 59-62%, commit 63e6af9; a TMA ring with streaming warpgroups and a
     producer/GEMM warpgroup, 56% / 63% for post_pre: its ring read 128-byte pieces of rows 10 KB
     apart.)
     Otherwise (fp32 streams, other widths) the staged
     kernel: grid (K splits of D, token tiles of TB=64), 128 threads (one warpgroup).  The split is
     blockIdx.x, so a tile's K CTAs are resident together, and CTA k takes the chunks of DC=32
     columns k, k + K, k + 2K, ...: together they read K adjacent 64-byte pieces of each row (with
     K >= 8, 512 contiguous bytes and more) instead of pieces 10 KB apart.  Per chunk each thread
     owns 8 consecutive columns (a 16-byte bf16 vector) of two tokens: it forms h_new, stores h_new
     and x (each the only time those bytes move), adds h_new^2 to a per-token register sum, and
     stages h_new as bf16 into shared memory (fp32 streams: three bf16 pieces, hi + mid + lo, which
     represent the fp32 value to 2^-24).  fn's chunk is read by every CTA (so each fn element serves
     64 tokens from L2) and split the same way into three bf16 pieces.  The mixes GEMM
     [64 tok x 4*DC] x [4*DC x 32] then runs on the tensor cores as bf16 x bf16: the products of
     bf16 pieces are exact, and the pieces' cross terms sum to the fp32 product to ~2^-24 relative,
     so no TF32 is involved (bf16 streams: 3 GEMMs per chunk, fp32 streams: the 6 cross terms above
     2^-24).  Each chunk's GEMM accumulates from zero and is added to the CTA's total with IEEE fp32
     adds: the tensor cores' own accumulation drifts (about 3e-5 relative over D = 5120 when one
     accumulator spans all chunks).  Partial dot products and sums of squares go to a workspace
     [K, T, 32]; K is picked per call (`cuda_splits`).
     The streams go global -> shared with cp.async into `_STAGES` = 2 stages: chunk c + 1 is in
     flight while chunk c is computed and multiplied, and fn's loads are issued before chunk c's
     compute and used after it (155 registers, 86 KB of shared memory: 2 CTAs per SM, bf16).
     Three stages (two chunks in flight, 106 KB, still 2 CTAs per SM) measured no faster, and one
     CTA per SM with five stages much slower (BENCHMARKS.md): not the bytes in flight but, most
     likely, each CTA's serial chain per chunk (wait, compute, barriers, GEMM) limits it.  (Loading
     straight into registers with no overlap inside a CTA, 3 CTAs per SM, measured 36% / 51% of
     the bound at T = 4096 / 65536 on an H200 against this one's 41% / 47%: BENCHMARKS.md.)
  2. `finalize`: first the K partials of the CTA's token rows (32) of the workspace are summed in
     fixed order into shared memory, 8 lanes a row with one 16-byte vector each, so a lane has all
     its K loads in flight and a warp instruction reads 4 whole lines (each row lane loading its
     own 7 coefficients, 140 scalar loads a lane, was 1.01-1.03x slower at T = 4096 on an H100,
     with the same bits, BENCHMARKS.md).  Then 4 lanes per token (m = 4), one row of comb each,
     with pre and post of that index and the sum of squares: rsqrt and sigmoids, and the
     Sinkhorn of §5.2 with a row's sums in the lane and a column's as an xor-shuffle butterfly
     over the token's lanes; the quotients by one sum share one reciprocal, refined as div.rn's
     fast path refines it, so they are the IEEE quotients.
     (16 lanes per token, one comb entry each, every sum a butterfly and every quotient a
     division, gave bit-identical results with 2.3x the instructions; timed 3-5% slower at
     T = 1 and the same from 4096 tokens on, BENCHMARKS.md.)  Deterministic: no atomics.  Launched
     programmatically: the mixing kernel triggers at its start, so the finalize's launch overlaps
     its tail, and the finalize waits (griddepcontrol) before it reads the workspace.  After the
     column-resident kernel its K = D / 256 is fixed at build, so the K loops unroll.  (One thread per
     token, with the Sinkhorn's 39 normalisations serial in it, took 50 us at any T: ~99K cycles of
     dependent divisions, more than the main kernel at T = 1.)
"""

import functools
from types import SimpleNamespace

import tilelang.cpu.language as TC
import tilelang.cuda.language as TCU
import tilelang.language as T
import torch
from dsv41c.tilelang_kernels.quant import (
    CUDA_PACK_BF16X2,
    NO_SYNC_ATTR,
    _bits,
    _store,
    compile_for,
    cuda_trace_prelude,
    define_op,
    device_target,
    trace_macros,
)

from dsv41c import mhc

__all__ = [
    "KINDS",
    "build",
    "cuda_splits",
    "mhc_post_collapse",
    "mhc_post_collapse_ref",
    "mhc_post_pre",
    "mhc_post_pre_ref",
    "mhc_pre",
    "mhc_pre_ref",
    "mhc_prim_funcs",
]

KINDS = ("pre", "post_pre", "post_collapse")
TB = 64  # CUDA: tokens per CTA (the wgmma M)
DC = 32  # CUDA: columns of each stream per chunk
_THREADS = 128  # CUDA post_collapse: threads per CTA
_MIX_THREADS = 128  # CUDA mixing kernels: threads per CTA
_NPAD = 32  # CUDA: GEMM N, the mix coefficients padded; column 24 (mix) of the workspace = sum of squares
_FIN_ROW = 36  # CUDA finalize: floats a token row of the shared sums of the workspace (rows 4 banks apart)
_STAGES = 2  # CUDA mixing kernels: chunks of streams in shared memory (the pipeline's depth)
_CTAS_PER_SM = 2  # CUDA: resident mixes CTAs per H200 SM (shared memory: 86 KB each at 2 stages)
_CR_W = 256  # CUDA column-resident mixing kernel: columns of each stream per CTA (fn's slice stays in
#               shared memory): 8 per lane, so one warp-wide 16-byte access covers them
_CR_WAVES = 2  # CUDA column-resident mixing kernel: at most this many waves of CTAs (at one per SM)
_SMS = 132  # H200 SMs
# CUDA mixing kernel for bf16 streams (`_cuda_wg_prim_func`, timed on an H200, BENCHMARKS.md "mHC
# kernels"): tokens per block (the wgmma's N); tokens per streaming warp and block (so BLK / TPW
# streaming warps); accumulators the block's k steps are split over; registers per thread of the
# GEMM warpgroup (setmaxnreg gives the rest to the streaming warps)
_WG_BLK = 16
_WG_TPW = 2
_WG_KSPLIT = 4
_WG_GEMM_REGS = 88
# CUDA mixing kernel for bf16 streams: blocks whose streams are in flight while one is computed, for
# pre and post_pre (2: three register sets, the block loop unrolled by three).  Timed on an H200
# (BENCHMARKS.md "mHC kernels"): 2 takes pre from 65% to 69% of the bound at T = 65536; it takes
# post_pre from 76% to 65% (its three sets spill).
_WG_AHEAD_PRE = 2
_WG_AHEAD_POST_PRE = 1
# CUDA mixing kernel for bf16 streams: 1, the workspace rows are stored with an L2 evict-last
# policy, so that the finalize may find them in L2 behind the streams (at T = 4096 it read them from
# DRAM: an 11.8% L2 hit rate on an H100).  Prepared, not yet timed on a GPU (BENCHMARKS.md, mHC
# kernels, "2026-12-06 (evict-last)"); 0 keeps the lowered sources the kernel's.
_WG_WS_KEEP = 0
# CUDA, a diagnostic: 0, or (set by `benchmarks/mhc.py --trace` before its first build) the device
# address of an int64 buffer [CTAs, TRACE_SLOTS] into which the wgmma mixing kernel writes SM clocks
# (clock64) at the marks of `_TRACE_MARKS`: thread 0 (the first streaming warp) at the start, after
# the setup and after each of its first 16 blocks' streaming; the GEMM warpgroup's first thread after
# each of its first 8 blocks' epilogues and at its end; with the global timer at the start and the
# end.  0 builds no marks: the lowered source is the kernel's.
_TRACE = 0
TRACE_SLOTS = 32
_TRACE_STREAM_BLOCKS, _TRACE_GEMM_BLOCKS = 16, 8
_TRACE_MARKS = {0: "start", 1: "fn's slice in shared memory (setup)",
                **{4 + i: f"streaming: block {i}" for i in range(_TRACE_STREAM_BLOCKS)},
                2: "streaming: the last block",
                **{20 + i: f"GEMM warpgroup: block {i}'s epilogue" for i in range(_TRACE_GEMM_BLOCKS)},
                3: "GEMM warpgroup: the last epilogue"}
_TRACE_SM, _TRACE_T0, _TRACE_T1 = 28, 30, 31  # slots: SM number; global timer (ns) at marks 0 and 3
# the streaming thread's marks; the GEMM warpgroup's, after the setup's barrier
_TRACE_CHAINS = [[0, 1, *range(4, 4 + _TRACE_STREAM_BLOCKS), 2], [1, *range(20, 20 + _TRACE_GEMM_BLOCKS), 3]]


def column_resident(kind: str, dtype: str, D: int) -> bool:
    """Whether a CUDA mixing op runs the column-resident kernel rather than the staged one: bf16
    streams whose width is a multiple of its column group `_CR_W`."""
    return kind in ("pre", "post_pre") and dtype == "bfloat16" and D % _CR_W == 0


# ------------------------------------------------------------------------------------- refs

def mhc_pre_ref(h, fn, scale, base, pre_delayed, *, norm_eps, hc_eps, iters):
    """x = collapse(h, pre_delayed) and the mixes of h: what `mhc_pre` computes."""
    return (mhc.hc_collapse(h, pre_delayed),
            *mhc.hc_mixes(h, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters))


def mhc_post_collapse_ref(y, res, post, comb, pre_delayed):
    """h_new = expand(y, res, post, comb), x = collapse(h_new, pre_delayed)."""
    h_new = mhc.hc_expand(y, res, post, comb)
    return h_new, mhc.hc_collapse(h_new, pre_delayed)


def mhc_post_pre_ref(y, res, post, comb, pre_delayed, fn, scale, base, *, norm_eps, hc_eps, iters):
    """`mhc_post_collapse_ref` plus the mixes of h_new for the following sublayer."""
    h_new, x = mhc_post_collapse_ref(y, res, post, comb, pre_delayed)
    return (h_new, x,
            *mhc.hc_mixes(h_new, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters))


# ------------------------------------------------------------------------------------- shared TIR

def _f32_const(v: float):
    """An fp32 constant entered by its bits: the C codegen prints floats with 7 digits."""
    bits = torch.tensor(v, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
    return T.reinterpret(T.uint32(bits), "float32")


def _ld(v):
    """fp32 value of an element of an fp32, bf16 or uint16-holding-bf16 buffer."""
    if str(v.dtype) == "float32":
        return v
    if str(v.dtype) == "bfloat16":
        return T.Cast("float32", v)
    return T.reinterpret(_bits(v), "float32")


def _arith(cuda: bool):
    """(mul, add) with one IEEE rounding each; CUDA needs the intrinsics to stop FMA contraction."""
    if cuda:
        return (lambda a, b: T.call_extern("float32", "__fmul_rn", a, b),
                lambda a, b: T.call_extern("float32", "__fadd_rn", a, b))
    return (lambda a, b: a * b), (lambda a, b: a + b)


def _finalize_macro(m: int, n_flat: int, norm_eps: float, hc_eps: float, iters: int):
    """Mixes of one token t from acc[0:mix] = fn . s and acc[mix] = sum(s^2): §5.1 and §5.2.
    c is an m*m local scratch.  The C build's (the CUDA finalize kernel spreads a token over lanes)."""
    mix = 2 * m + m * m

    @T.macro
    def finalize(acc, c, SC, BASE, PRE, POST, COMB, t):
        r = T.alloc_var("float32")
        s = T.alloc_var("float32")
        r = T.float32(1) / T.sqrt(acc[mix] / T.float32(n_flat) + _f32_const(norm_eps))
        for j in T.unroll(m):
            PRE[t, j] = T.sigmoid(acc[j] * r * SC[0] + BASE[j]) + _f32_const(hc_eps)
            POST[t, j] = T.float32(2) * T.sigmoid(acc[m + j] * r * SC[1] + BASE[m + j])
        for q in T.unroll(m * m):
            c[q] = acc[2 * m + q] * r * SC[2] + BASE[2 * m + q]
        for i in T.unroll(m):  # row softmax, then + eps
            s = c[i * m]
            for j in T.unroll(1, m):
                s = T.max(s, c[i * m + j])
            for j in T.unroll(m):
                c[i * m + j] = T.exp(c[i * m + j] - s)
            r = c[i * m]
            for j in T.unroll(1, m):
                r = r + c[i * m + j]
            for j in T.unroll(m):
                c[i * m + j] = c[i * m + j] / r + _f32_const(hc_eps)
        for it in T.serial(2 * iters - 1):  # column, (row, column) x (iters - 1)
            if it % 2 == 0:
                for j in T.unroll(m):
                    s = c[j]
                    for i in T.unroll(1, m):
                        s = s + c[i * m + j]
                    for i in T.unroll(m):
                        c[i * m + j] = c[i * m + j] / (s + _f32_const(hc_eps))
            else:
                for i in T.unroll(m):
                    s = c[i * m]
                    for j in T.unroll(1, m):
                        s = s + c[i * m + j]
                    for j in T.unroll(m):
                        c[i * m + j] = c[i * m + j] / (s + _f32_const(hc_eps))
        for i in T.unroll(m):
            for j in T.unroll(m):
                COMB[t, i, j] = c[i * m + j]
    return finalize


_SHAPES = {  # buffer name -> (shape, dtype) with N = tokens, S = stream dtype, K = CUDA splits of D
    "H": ("NmD", "S"), "Y": ("ND", "S"), "RES": ("NmD", "S"), "HN": ("NmD", "S"), "X": ("ND", "S"),
    "PIN": ("Nm", "f"), "CIN": ("Nmm", "f"), "PD": ("Nm", "f"), "PRE": ("Nm", "f"), "POST": ("Nm", "f"),
    "COMB": ("Nmm", "f"), "FN": ("xF", "f"), "SC": ("3", "f"), "BASE": ("x", "f"), "WS": ("KNP", "f"),
}
_PARAMS = {  # (kind, role) -> parameter names, inputs first
    ("pre", "c"): ("H", "FN", "SC", "BASE", "PD", "X", "PRE", "POST", "COMB"),
    ("post_pre", "c"): ("Y", "RES", "PIN", "CIN", "PD", "FN", "SC", "BASE", "HN", "X", "PRE", "POST", "COMB"),
    ("post_collapse", "c"): ("Y", "RES", "PIN", "CIN", "PD", "HN", "X"),
    ("pre", "main"): ("H", "FN", "PD", "X", "WS"),
    ("post_pre", "main"): ("Y", "RES", "PIN", "CIN", "PD", "FN", "HN", "X", "WS"),
    ("post_collapse", "main"): ("Y", "RES", "PIN", "CIN", "PD", "HN", "X"),
    ("finalize", "main"): ("WS", "SC", "BASE", "PRE", "POST", "COMB"),
}


def _buffers(names, sdt, m, D, splits=1):
    """The T.Tensor types of `names` as attributes, with one symbolic token count N."""
    N = T.dynamic("N")
    dims = {"N": N, "m": m, "D": D, "3": 3, "x": 2 * m + m * m, "F": m * D, "K": splits, "P": _NPAD}
    return SimpleNamespace(**{n: T.Tensor(tuple(dims[c] for c in _SHAPES[n][0]),
                                          sdt if _SHAPES[n][1] == "S" else "float32") for n in names}), N


def _prim_func(names, S, body):
    """The prim_func with parameters `names` (a `_PARAMS` entry), typed by S; body is a macro that
    takes the buffers as a dict, so one body serves every parameter list of its target."""
    if names == _PARAMS["pre", "c"]:
        @T.prim_func
        def main(H: S.H, FN: S.FN, SC: S.SC, BASE: S.BASE, PD: S.PD, X: S.X,
                 PRE: S.PRE, POST: S.POST, COMB: S.COMB):
            body(dict(zip(names, (H, FN, SC, BASE, PD, X, PRE, POST, COMB))))
    elif names == _PARAMS["post_pre", "c"]:
        @T.prim_func
        def main(Y: S.Y, RES: S.RES, PIN: S.PIN, CIN: S.CIN, PD: S.PD, FN: S.FN,
                 SC: S.SC, BASE: S.BASE, HN: S.HN, X: S.X, PRE: S.PRE, POST: S.POST,
                 COMB: S.COMB):
            body(dict(zip(names, (Y, RES, PIN, CIN, PD, FN, SC, BASE, HN, X, PRE, POST, COMB))))
    elif names == _PARAMS["post_collapse", "c"]:
        @T.prim_func
        def main(Y: S.Y, RES: S.RES, PIN: S.PIN, CIN: S.CIN, PD: S.PD, HN: S.HN,
                 X: S.X):
            body(dict(zip(names, (Y, RES, PIN, CIN, PD, HN, X))))
    elif names == _PARAMS["pre", "main"]:
        @T.prim_func
        def main(H: S.H, FN: S.FN, PD: S.PD, X: S.X, WS: S.WS):
            body(dict(zip(names, (H, FN, PD, X, WS))))
    elif names == _PARAMS["post_pre", "main"]:
        @T.prim_func
        def main(Y: S.Y, RES: S.RES, PIN: S.PIN, CIN: S.CIN, PD: S.PD, FN: S.FN,
                 HN: S.HN, X: S.X, WS: S.WS):
            body(dict(zip(names, (Y, RES, PIN, CIN, PD, FN, HN, X, WS))))
    else:
        assert names == _PARAMS["finalize", "main"], names

        @T.prim_func
        def main(WS: S.WS, SC: S.SC, BASE: S.BASE, PRE: S.PRE, POST: S.POST,
                 COMB: S.COMB):
            body(dict(zip(names, (WS, SC, BASE, PRE, POST, COMB))))
    return main


# ------------------------------------------------------------------------------------- C target

def _cpu_prim_func(kind, dtype, m, D, norm_eps, hc_eps, iters):
    sdt = "uint16" if dtype == "bfloat16" else dtype
    names = _PARAMS[kind, "c"]
    S, N = _buffers(names, sdt, m, D)
    mix = 2 * m + m * m
    mixes, expand = kind != "post_collapse", kind != "pre"
    finalize = _finalize_macro(m, m * D, norm_eps, hc_eps, iters)
    mul, add = _arith(False)

    @T.macro
    def column(B, t, d, v):
        """Column d of token t: h_new (stored), x, and v = the stream as stored, in fp32."""
        s = T.alloc_var("float32")
        if expand:
            for j in T.serial(m):
                s = mul(B["CIN"][t, 0, j], _ld(B["RES"][t, 0, d]))
                for i in T.serial(1, m):
                    s = add(s, mul(B["CIN"][t, i, j], _ld(B["RES"][t, i, d])))
                B["HN"][t, j, d] = _store(sdt, add(mul(B["PIN"][t, j], _ld(B["Y"][t, d])), s))
                v[j] = _ld(B["HN"][t, j, d])  # the stored (rounded) stream
        else:
            for j in T.serial(m):
                v[j] = _ld(B["H"][t, j, d])
        s = mul(B["PD"][t, 0], v[0])
        for j in T.serial(1, m):
            s = add(s, mul(B["PD"][t, j], v[j]))
        B["X"][t, d] = _store(sdt, s)

    @T.macro
    def body(B):
        with TC.Kernel(N) as t:
            acc = T.alloc_local((mix + 1,), "float32")
            part = T.alloc_local((mix + 1,), "float32")
            c = T.alloc_local((m * m,), "float32")
            v = T.alloc_local((m,), "float32")
            T.clear(acc)
            # The mixes sum over blocks of DC columns, each block's m*DC products on their own,
            # then the blocks in order: the fp32 error grows with m*DC + D/DC terms, not m*D.
            for b in T.serial(T.ceildiv(D, DC)):
                T.clear(part)
                for dd in T.serial(DC):
                    if b * DC + dd < D:
                        column(B, t, b * DC + dd, v)
                        if mixes:
                            for j in T.serial(m):
                                part[mix] = part[mix] + v[j] * v[j]
                                for q in T.serial(mix):
                                    part[q] = part[q] + B["FN"][q, j * D + b * DC + dd] * v[j]
                if mixes:
                    for q in T.serial(mix + 1):
                        acc[q] = acc[q] + part[q]
            if mixes:
                finalize(acc, c, B["SC"], B["BASE"], B["PRE"], B["POST"], B["COMB"], t)

    return names, _prim_func(names, S, body)


# ------------------------------------------------------------------------------------- builds

def mhc_prim_funcs(kind, dtype, m, D, norm_eps, hc_eps, iters, target):
    """[(parameter names, prim_func)] of one op: its C kernel on "c"; on "cuda" the main kernel
    (the mixes kernel, or for post_collapse the flat streaming kernel), then for the mixing kinds
    the finalize kernel."""
    if kind not in KINDS or dtype not in ("float32", "bfloat16") or m < 1 or D < 1:
        raise ValueError(f"mhc kernels: unknown kind/dtype/shape {kind!r}/{dtype!r}/m={m}/D={D}")
    if target == "c":
        return [_cpu_prim_func(kind, dtype, m, D, norm_eps, hc_eps, iters)]
    if kind == "post_collapse":
        return [_cuda_stream_prim_func(dtype, m, D)]
    if column_resident(kind, dtype, D):
        main, splits = _cuda_wg_prim_func(kind, m, D), D // _CR_W
    else:
        main, splits = _cuda_mixes_prim_func(kind, dtype, m, D), None
    return [main, _cuda_finalize_prim_func(m, D, norm_eps, hc_eps, iters, splits)]


@functools.cache
def build(kind: str, dtype: str, m: int, D: int, norm_eps: float, hc_eps: float, iters: int,
          target: str):
    """((parameter names, compiled kernel), ...) of one op, once per process per key; target "c"
    (CPU) or "cuda[:sm_XX]".  T is a dynamic dimension, so one build serves every token count."""
    fns = mhc_prim_funcs(kind, dtype, m, D, norm_eps, hc_eps, iters, "c" if target == "c" else "cuda")
    return tuple((names, compile_for(f, target)) for names, f in fns)


@functools.lru_cache(maxsize=1024)  # called per op call: the search over divisors costs ~10 us of host time
def cuda_splits(D: int, n: int, sms: int = _SMS) -> int:
    """CTAs along D per token tile of the staged kernel for T = n tokens: a divisor K of the chunks
    of D (of DC columns), with the workspace (K x 128 B per token) kept under ~3% of the stream
    traffic unless all the CTAs fit in one wave.  With `_CTAS_PER_SM` per SM, K minimises waves x
    chunks per CTA, preferring K >= 8 (the tile's CTAs then read at least 512 contiguous bytes of a
    row together); at T = 1 every chunk gets its own CTA, and the latency is one chunk's."""
    chunks, tiles = D // DC, -(-n // TB)
    slots = _CTAS_PER_SM * sms
    cap = max(1, (D * 2 * 10) * 3 // 100 // (_NPAD * 4))
    ks = [k for k in range(1, chunks + 1) if chunks % k == 0 and (k <= cap or tiles * k <= slots)]
    return min(ks, key=lambda k: (-(-tiles * k // slots) * (chunks // k), k < 8, k))


# ------------------------------------------------------------------------------------- torch.library ops

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# each op's tensor arguments in schema order, as kernel parameter names; its outputs; its first
# stream, which gives T, m, D and the stream dtype
_INPUTS = {"pre": ("H", "FN", "SC", "BASE", "PD"),
           "post_pre": ("Y", "RES", "PIN", "CIN", "PD", "FN", "SC", "BASE"),
           "post_collapse": ("Y", "RES", "PIN", "CIN", "PD")}
_OUTPUTS = {"pre": ("X", "PRE", "POST", "COMB"), "post_pre": ("HN", "X", "PRE", "POST", "COMB"),
            "post_collapse": ("HN", "X")}
_LEAD = {"pre": "H", "post_pre": "RES", "post_collapse": "RES"}
_ARG_NAMES = {"H": "h", "Y": "y", "RES": "res", "PIN": "post", "CIN": "comb", "PD": "pre_delayed", "FN": "fn",
              "SC": "scale", "BASE": "base"}


def _signature(tensors) -> tuple:
    """What the argument checks read of each tensor: the key of `_plan`."""
    return tuple([(t.shape, t.dtype, t.device) for t in tensors])  # (a list is faster to build)


@functools.lru_cache(maxsize=1024)  # one entry per op, shape and device: the checks run once per key
def _plan(kind, sig, eps):
    """Check an op's arguments from their `_signature` sig and plan its launch: (T, m, D, target,
    ((kernel, positions of its parameters in inputs + outputs + workspace), ...), workspace shape
    or None).  Raises ValueError naming the first bad argument."""
    op, names = f"mhc_{kind}", _INPUTS[kind]
    shape0, sdt, device = sig[names.index(_LEAD[kind])]
    if len(shape0) != 3 or sdt not in _DTYPES:
        raise ValueError(f"{op}: {_ARG_NAMES[_LEAD[kind]]} must be [T, m, D] fp32 or bf16, got {sdt} {tuple(shape0)}")
    n, m, d = shape0
    mix = 2 * m + m * m
    dims = {"N": n, "m": m, "D": d, "3": 3, "x": mix, "F": m * d}
    for name, (shape, dtype, dev) in zip(names, sig, strict=True):
        want = tuple(dims[c] for c in _SHAPES[name][0]), sdt if _SHAPES[name][1] == "S" else torch.float32
        if (tuple(shape), dtype, dev) != (*want, device):
            raise ValueError(f"{op}: {_ARG_NAMES[name]} must be {want[1]} {want[0]} on {device}, "
                             f"got {dtype} {tuple(shape)} on {dev}")
    target = device_target(device, "mhc")
    mixing = "FN" in names
    if target != "c" and (d % DC or (mixing and (mix > _NPAD - 1 or n > 65535 * TB))):
        raise ValueError(f"{op}: the CUDA build needs D % {DC} == 0, 2m + m^2 < {_NPAD} and at most "
                         f"{65535 * TB} tokens (grid y), got D={d}, m={m}, T={n}")
    if n == 0:  # nothing to launch (and nothing to build)
        return n, m, d, target, (), None
    ws = None
    if target != "c" and mixing:
        ws = (d // _CR_W if column_resident(kind, _DTYPES[sdt], d) else cuda_splits(d, n), n, _NPAD)
    slots = (*names, *_OUTPUTS[kind], "WS")
    kernels = tuple((kernel, tuple(slots.index(p) for p in params))
                    for params, kernel in build(kind, _DTYPES[sdt], m, d, *eps, target))
    return n, m, d, target, kernels, ws


def _kernel_arg(t: torch.Tensor, target: str) -> torch.Tensor:
    """An input as a kernel argument: contiguous, 16-byte aligned for the CUDA vector accesses; bf16
    as uint16 bits for the C build."""
    t = t.contiguous()
    if target != "c" and t.data_ptr() % 16:
        t = t.clone()
    return t.view(torch.uint16) if target == "c" and t.dtype == torch.bfloat16 else t


def _run(kind, inputs, eps, outputs):
    """Check the op's inputs (once per `_plan` key), allocate its outputs with `outputs(T, m, D)`,
    run its kernels (the CUDA mixing kinds: over a fresh workspace) and return the outputs."""
    n, m, d, target, kernels, ws = _plan(kind, _signature(inputs), eps)
    outs = outputs(n, m, d)
    if n:
        args = [_kernel_arg(t, target) for t in inputs]
        if target == "c":  # the outputs are fresh contiguous tensors: views, not copies
            args += [_kernel_arg(t, target) for t in outs]
        else:
            args += outs
            if ws is not None:
                args.append(outs[0].new_empty(ws, dtype=torch.float32))
        for kernel, slots in kernels:
            kernel(*[args[i] for i in slots])
    return outs


def _mixes_out(n, m, like):
    return (like.new_empty((n, m), dtype=torch.float32), like.new_empty((n, m), dtype=torch.float32),
            like.new_empty((n, m, m), dtype=torch.float32))


def _streams_out(res):
    n, m, d = res.shape
    return torch.empty_like(res, memory_format=torch.contiguous_format), res.new_empty((n, d))


def _pre(h, fn, scale, base, pre_delayed, norm_eps, hc_eps, iters):
    return _run("pre", (h, fn, scale, base, pre_delayed), (norm_eps, hc_eps, iters),
                lambda n, m, d: (h.new_empty((n, d)), *_mixes_out(n, m, h)))


def _pre_fake(h, fn, scale, base, pre_delayed, norm_eps, hc_eps, iters):
    n, m, d = h.shape
    return (h.new_empty((n, d)), *_mixes_out(n, m, h))


def _post_pre(y, res, post, comb, pre_delayed, fn, scale, base, norm_eps, hc_eps, iters):
    return _run("post_pre", (y, res, post, comb, pre_delayed, fn, scale, base), (norm_eps, hc_eps, iters),
                lambda n, m, d: (*_streams_out(res), *_mixes_out(n, m, res)))


def _post_pre_fake(y, res, post, comb, pre_delayed, fn, scale, base, norm_eps, hc_eps, iters):
    n, m, _ = res.shape
    return (*_streams_out(res), *_mixes_out(n, m, res))


def _post_collapse(y, res, post, comb, pre_delayed):
    return _run("post_collapse", (y, res, post, comb, pre_delayed), (0.0, 0.0, 0), lambda n, m, d: _streams_out(res))


def _post_collapse_fake(y, res, post, comb, pre_delayed):
    return _streams_out(res)


_KW = "float norm_eps, float hc_eps, int iters"
_OPS = {}
for _name, _impl, _fake, _schema in (
        ("mhc_pre", _pre, _pre_fake,
         (f"(Tensor h, Tensor fn, Tensor scale, Tensor base, Tensor pre_delayed, *, {_KW}) "
          "-> (Tensor, Tensor, Tensor, Tensor)")),
        ("mhc_post_pre", _post_pre, _post_pre_fake,
         ("(Tensor y, Tensor res, Tensor post, Tensor comb, Tensor pre_delayed, Tensor fn, Tensor scale, "
          f"Tensor base, *, {_KW}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")),
        ("mhc_post_collapse", _post_collapse, _post_collapse_fake,
         "(Tensor y, Tensor res, Tensor post, Tensor comb, Tensor pre_delayed) -> (Tensor, Tensor)")):
    _OPS[_name] = define_op(_name, _schema, _impl, _fake)


def mhc_pre(h, fn, scale, base, pre_delayed, *, norm_eps, hc_eps, iters):
    """h [T,m,D] -> (x [T,D], pre, post, comb); = mhc_pre_ref."""
    return torch.ops.dsv41c.mhc_pre(h, fn, scale, base, pre_delayed, norm_eps=norm_eps, hc_eps=hc_eps,
                                    iters=iters)


def mhc_post_pre(y, res, post, comb, pre_delayed, fn, scale, base, *, norm_eps, hc_eps, iters):
    """(y [T,D], res [T,m,D], ...) -> (h_new, x, pre', post', comb'); = mhc_post_pre_ref."""
    return torch.ops.dsv41c.mhc_post_pre(y, res, post, comb, pre_delayed, fn, scale, base,
                                         norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)


def mhc_post_collapse(y, res, post, comb, pre_delayed):
    """(y [T,D], res [T,m,D], post, comb, pre_delayed) -> (h_new, x); = mhc_post_collapse_ref."""
    return torch.ops.dsv41c.mhc_post_collapse(y, res, post, comb, pre_delayed)


# ------------------------------------------------------------------------------------- CUDA

def _bf16_pieces(v, n):
    """n bf16 values whose sum is the fp32 v to within 2^-24 relative (n = 1: v is a bf16 value)."""
    out, r = [], v
    for i in range(n):
        b = T.Cast("bfloat16", r)
        out.append(b)
        if i + 1 < n:
            r = r - T.Cast("float32", b)
    return out


def _expand_exprs(m, co, xs, mul, add):
    """fp32 expressions of h_new[j], j = 0..m-1, for one column, in the reference's operation order
    (module docstring).  co(k) is the token's coefficient k (post 0..m-1, then comb row-major);
    xs(r) the fp32 value of source stream r (r = m: y)."""
    out = []
    for j in range(m):
        s = mul(co(m + j), xs(0))
        for i in range(1, m):
            s = add(s, mul(co(m + i * m + j), xs(i)))
        out.append(add(mul(co(j), xs(m)), s))
    return out


def _collapse_expr(m, pd, hv, mul, add):
    """fp32 expression of x = sum_j pd(j) * hv[j], in order j = 0..m-1."""
    s = mul(pd(0), hv[0])
    for j in range(1, m):
        s = add(s, mul(pd(j), hv[j]))
    return s


def _cuda_stream_prim_func(dtype, m, D):
    """post_collapse: the flat streaming kernel (module docstring, CUDA)."""
    names = _PARAMS["post_collapse", "main"]
    S, N = _buffers(names, dtype, m, D)
    vec, vw = 8, 16 // (4 if dtype == "float32" else 2)
    ipt = D // vec  # items (8 columns of one token) per token
    U = 2  # items per thread
    mul, add = _arith(True)

    @T.macro
    def body(B):
        with T.Kernel(T.ceildiv(N * ipt, _THREADS * U), threads=_THREADS) as bx:
            tx = T.get_thread_binding()
            xl = T.alloc_local((U, m + 1, vec), dtype)
            co = T.alloc_local((U, 2 * m + m * m), "float32")
            ol = T.alloc_local((m, vec), dtype)
            xo = T.alloc_local((vec,), dtype)
            hv = T.alloc_local((m,), "float32")
            for u in T.unroll(U):  # all loads first: 2 x (m + 1) x 16 B in flight per thread
                g = (bx * U + u) * _THREADS + tx
                t = g // ipt
                if t < N:
                    for j in T.vectorized(m):
                        co[u, j] = B["PIN"][t, j]
                        co[u, m + m * m + j] = B["PD"][t, j]
                    for i in T.unroll(m):
                        for j in T.vectorized(m):
                            co[u, m + i * m + j] = B["CIN"][t, i, j]
                    for h2 in T.unroll(vec // vw):
                        for j in T.unroll(m):
                            for e in T.vectorized(vw):
                                xl[u, j, h2 * vw + e] = B["RES"][t, j, g % ipt * vec + h2 * vw + e]
                        for e in T.vectorized(vw):
                            xl[u, m, h2 * vw + e] = B["Y"][t, g % ipt * vec + h2 * vw + e]
            for u in T.unroll(U):
                g = (bx * U + u) * _THREADS + tx
                t = g // ipt
                for e in T.unroll(vec):
                    # (the lambdas are called at once, at trace time)
                    for j, hj in enumerate(_expand_exprs(
                            m, lambda coef: co[u, coef], lambda src_row: T.Cast("float32", xl[u, src_row, e]),  # noqa: B023
                            mul, add)):
                        ol[j, e] = T.Cast(dtype, hj)
                        hv[j] = T.Cast("float32", ol[j, e])
                    xo[e] = T.Cast(dtype, _collapse_expr(m, lambda pd_j: co[u, m + m * m + pd_j], hv, mul, add))  # noqa: B023
                if t < N:
                    for h2 in T.unroll(vec // vw):
                        for e in T.vectorized(vw):
                            B["X"][t, g % ipt * vec + h2 * vw + e] = xo[h2 * vw + e]
                        for j in T.unroll(m):
                            for e in T.vectorized(vw):
                                B["HN"][t, j, g % ipt * vec + h2 * vw + e] = ol[j, h2 * vw + e]

    return names, _prim_func(names, S, body)


def _cuda_mixes_prim_func(kind, dtype, m, D):
    """The streaming kernel with the mixes GEMM (module docstring, CUDA step 1)."""
    expand = kind == "post_pre"
    names = _PARAMS[kind, "main"]
    splits = T.dynamic("K")  # CTAs along D: the workspace's leading dim, chosen per call (`cuda_splits`)
    S, N = _buffers(names, dtype, m, D, splits)
    mix = 2 * m + m * m
    nch = D // DC // splits  # chunks per CTA
    kc = m * DC  # GEMM K per chunk
    vec = 8  # stream values per thread item (16 B of bf16)
    vw = 16 // (4 if dtype == "float32" else 2)  # values per 16-byte access
    ipr = DC // vec  # items per token row of a chunk
    U = TB * ipr // _MIX_THREADS  # items per thread
    rows = list(range(m + 1 if expand else m))  # stream rows per token (+ y); a list: unrolled at trace time
    npa = 1 if dtype == "bfloat16" else 3  # bf16 pieces of a stream value
    pieces = list(range(npa))
    pairs = [(a, b) for a in range(npa) for b in range(3) if a + b <= 2]
    nfv = mix * kc // 4  # float4 vectors of fn per chunk
    FU = -(-nfv // _MIX_THREADS)
    ncf = (m + m * m if expand else 0) + m  # per-token coefficients: post, comb, pre_delayed
    src = "RES" if expand else "H"
    mul, add = _arith(True)
    assert TB * ipr % _MIX_THREADS == 0 and D % DC == 0

    def row(B, r, t, c):
        """Element (t, c) of stream r of the source (r = m: y)."""
        return B["Y"][t, c] if r == m else B[src][t, r, c]

    @T.macro
    def load_fn(B, fl, tx, d0):
        """fn's chunk at column d0 of every stream, as float4 vectors, into registers."""
        for u in T.unroll(FU):
            q = u * _MIX_THREADS + tx
            if FU * _MIX_THREADS == nfv or q < nfv:
                for e in T.vectorized(4):
                    fl[u, e] = B["FN"][q // (kc // 4), (q % (kc // 4)) * 4 // DC * D + d0
                                       + (q % (kc // 4)) * 4 % DC + e]

    @T.macro
    def split_fn(fl, bl, Bs, tx):
        """fn's chunk into Bs as three bf16 pieces."""
        for u in T.unroll(FU):
            q = u * _MIX_THREADS + tx
            if FU * _MIX_THREADS == nfv or q < nfv:
                for e in T.unroll(4):
                    for p, piece in enumerate(_bf16_pieces(fl[u, e], 3)):
                        bl[p, e] = piece
                for p in [0, 1, 2]:
                    for e in T.vectorized(4):
                        Bs[p][q // (kc // 4), (q % (kc // 4)) * 4 + e] = bl[p, e]

    @T.macro
    def issue_streams(B, St, stage, bt, tx, d0):
        """cp.async of the chunk's streams into St[stage]; rows past N are zero-filled."""
        for u in T.unroll(U):
            it = u * _MIX_THREADS + tx
            t = bt * TB + it // ipr
            for h2 in T.unroll(vec // vw):
                for r in rows:
                    T.ptx_cp_async(T.access_ptr(St[stage, it // ipr, r, it % ipr * vec + h2 * vw], "w"),
                                   T.access_ptr(row(B, r, t, d0 + it % ipr * vec + h2 * vw), "r"), vw,
                                   predicate=t < N)

    @T.macro
    def body(B):
        # The D split is blockIdx.x, so the K CTAs of a token tile are launched together, and CTA k
        # takes chunks k, k + K, k + 2K, ...: at any time the tile's CTAs read K adjacent 64-byte
        # pieces of each row, K * 64 contiguous bytes, instead of 64 bytes 10 KB apart.
        with T.Kernel(splits, T.ceildiv(N, TB), threads=_MIX_THREADS) as (bk, bt):
            tx = T.get_thread_binding()
            TCU.pdl_trigger()  # the finalize kernel may launch once every CTA of this one has started
            # the chunks' streams in _STAGES stages; token stride (m + 1) * DC values for every kind
            # (bf16: 320 B) keeps the 16-byte accesses of 8 lanes (two tokens) on distinct banks
            St = T.alloc_shared((_STAGES, TB, m + 1, DC), dtype)
            for s in range(_STAGES - 1):  # the prologue: chunks 0 .. _STAGES - 2 in flight
                if s == 0:  # (a Python test: every CTA has chunk 0)
                    issue_streams(B, St, s, bt, tx, bk * DC)
                elif s < nch:
                    issue_streams(B, St, s, bt, tx, (s * splits + bk) * DC)
                T.ptx_commit_group()
            Co = T.alloc_shared((TB, ncf), "float32")  # per-token post, comb, pre_delayed
            xl = T.alloc_local((U, len(rows), vec), dtype)  # the chunk's streams (and y)
            ol = T.alloc_local((m, vec), dtype)  # h_new as stored
            xo = T.alloc_local((vec,), dtype)
            hv = T.alloc_local((m,), "float32")
            fl = T.alloc_local((FU, 4), "float32")
            As = [T.alloc_shared((TB, kc), "bfloat16") for _ in pieces]
            Bs = [T.alloc_shared((_NPAD, kc), "bfloat16") for _ in range(3)]
            Cs = T.alloc_shared((TB, _NPAD), "float32")
            Cf = T.alloc_fragment((TB, _NPAD), "float32")
            al = T.alloc_local((npa, m, vec), "bfloat16")
            Cc = T.alloc_fragment((TB, _NPAD), "float32")
            bl = T.alloc_local((3, 4), "bfloat16")
            sq = T.alloc_local((U,), "float32")
            T.clear(Cf)
            for u in T.unroll(U):
                sq[u] = T.float32(0)
            for q in T.serial(-(-(_NPAD - mix) * kc // _MIX_THREADS)):  # zero fn rows mix.._NPAD
                if q * _MIX_THREADS + tx < (_NPAD - mix) * kc:
                    for p in [0, 1, 2]:  # a Python list: unrolled at trace time
                        Bs[p][mix + (q * _MIX_THREADS + tx) // kc, (q * _MIX_THREADS + tx) % kc] = T.bfloat16(0)
            for q in T.serial(T.ceildiv(TB * ncf, _MIX_THREADS)):
                i = q * _MIX_THREADS + tx
                t = bt * TB + i // ncf
                if i < TB * ncf and t < N:
                    if i % ncf >= ncf - m:
                        Co[i // ncf, i % ncf] = B["PD"][t, i % ncf - (ncf - m)]
                    if expand:
                        if i % ncf >= m and i % ncf < ncf - m:
                            Co[i // ncf, i % ncf] = B["CIN"][t, (i % ncf - m) // m, (i % ncf - m) % m]
                        if i % ncf < m:
                            Co[i // ncf, i % ncf] = B["PIN"][t, i % ncf]
            for ch in T.serial(nch):
                d0 = (ch * splits + bk) * DC
                T.sync_threads()  # the previous chunk's GEMM has read As/Bs and its St stage
                if ch + _STAGES - 1 < nch:
                    issue_streams(B, St, (ch + _STAGES - 1) % _STAGES, bt, tx, d0 + (_STAGES - 1) * splits * DC)
                T.ptx_commit_group()  # (empty near the end: the wait below stays uniform)
                load_fn(B, fl, tx, d0)
                T.ptx_wait_group(_STAGES - 1)  # this thread's copies of chunk ch have landed
                T.sync_threads()  # and everyone's
                for u in T.unroll(U):
                    it = u * _MIX_THREADS + tx
                    for r in T.unroll(len(rows)):
                        for e in T.vectorized(vec):
                            xl[u, r, e] = St[ch % _STAGES, it // ipr, r, it % ipr * vec + e]
                for u in T.unroll(U):
                    it = u * _MIX_THREADS + tx
                    t = bt * TB + it // ipr
                    for e in T.unroll(vec):
                        if expand:
                            for j, hj in enumerate(_expand_exprs(  # (the lambdas: called at once, at trace time)
                                    m, lambda coef: Co[it // ipr, coef],  # noqa: B023
                                    lambda src_row: T.Cast("float32", xl[u, src_row, e]), mul, add)):  # noqa: B023
                                ol[j, e] = T.Cast(dtype, hj)
                                hv[j] = T.Cast("float32", ol[j, e])
                        else:
                            for j in rows[:m]:
                                hv[j] = T.Cast("float32", xl[u, j, e])
                        xo[e] = T.Cast(dtype, _collapse_expr(
                            m, lambda pd_j: Co[it // ipr, ncf - m + pd_j], hv, mul, add))  # noqa: B023
                        for j in T.unroll(m):
                            sq[u] = sq[u] + hv[j] * hv[j]
                            if npa > 1:
                                for p, piece in enumerate(_bf16_pieces(hv[j], npa)):
                                    al[p, j, e] = piece
                    if t < N:
                        c0 = d0 + it % ipr * vec
                        for h2 in T.unroll(vec // vw):
                            for e in T.vectorized(vw):
                                B["X"][t, c0 + h2 * vw + e] = xo[h2 * vw + e]
                            if expand:
                                for j in T.unroll(m):
                                    for e in T.vectorized(vw):
                                        B["HN"][t, j, c0 + h2 * vw + e] = ol[j, h2 * vw + e]
                    # the GEMM operand: the stream as stored, or its bf16 pieces
                    for j in T.unroll(m):
                        for p in pieces:
                            for e in T.vectorized(vec):
                                if npa > 1:
                                    As[p][it // ipr, j * DC + it % ipr * vec + e] = al[p, j, e]
                                elif expand:
                                    As[p][it // ipr, j * DC + it % ipr * vec + e] = ol[j, e]
                                else:
                                    As[p][it // ipr, j * DC + it % ipr * vec + e] = xl[u, j, e]
                split_fn(fl, bl, Bs, tx)  # (fn's loads had the stream compute to land)
                T.sync_threads()
                # Each chunk accumulates on its own and is added to the total in IEEE fp32: the
                # tensor cores' accumulation does not round like fp32 adds, and its error would
                # otherwise grow with D.
                T.clear(Cc)
                for a, b in pairs[::-1]:  # the small cross terms first
                    T.gemm(As[a], Bs[b], Cc, transpose_B=True)
                for i, j in T.Parallel(TB, _NPAD):
                    Cf[i, j] = Cf[i, j] + Cc[i, j]
            T.copy(Cf, Cs)
            for u in T.unroll(U):
                it = u * _MIX_THREADS + tx
                t = bt * TB + it // ipr
                for k in T.unroll(ipr.bit_length() - 1):  # the ipr lanes of one token row
                    sq[u] = sq[u] + T.shfl_xor(sq[u], 1 << k)
                if t < N and it % ipr == 0:
                    B["WS"][bk, t, mix] = sq[u]
            T.sync_threads()
            for u in T.unroll(TB * _NPAD // _MIX_THREADS):
                it = u * _MIX_THREADS + tx
                t = bt * TB + it // _NPAD
                if t < N and it % _NPAD < mix:
                    B["WS"][bk, t, it % _NPAD] = Cs[it // _NPAD, it % _NPAD]

    return names, _prim_func(names, S, body)


# CUDA: 16-byte global accesses at a running address p (an integer) plus a constant byte offset,
# which ptxas folds into the instruction's immediate
_RUNNING_ADDRS = """
__device__ __forceinline__ unsigned long long dsv41c_addr(const void* p) {
  return reinterpret_cast<unsigned long long>(p);
}
__device__ __forceinline__ void dsv41c_ldg128(unsigned long long p, long long off, void* d) {
  *reinterpret_cast<uint4*>(d) = __ldg(reinterpret_cast<const uint4*>(p + off));
}
__device__ __forceinline__ void dsv41c_stg128(unsigned long long p, long long off, const void* v) {
  const uint4 w = *reinterpret_cast<const uint4*>(v);  // (st.global: a plain store through an integer is generic)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p + off), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
               : "memory");
}
"""


def _bf16_half(word, u):
    """fp32 value of the bf16 in half u (0: low) of a uint32 word."""
    bits = word << T.uint32(16) if u == 0 else word & T.uint32(0xFFFF0000)
    return T.reinterpret(bits, "float32")


# CUDA, sm_90a: raw shared-memory stores, GMMA descriptors and wgmma for the wgmma mixing kernel
# (`_cuda_wg_prim_func`); every shared address is taken from the kernel's raw buffer `p` and
# rounded up to 1024 bytes (the 128-byte swizzle repeats every 8 rows of 128 B)
_WGMMA_PRELUDE = """
__device__ __forceinline__ unsigned dsv41c_sbase(const void* p) {
  return (static_cast<unsigned>(__cvta_generic_to_shared(p)) + 1023u) & ~1023u;
}
__device__ __forceinline__ void dsv41c_sts128(const void* p, unsigned off, unsigned a, unsigned b, unsigned c,
                                              unsigned d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(dsv41c_sbase(p) + off), "r"(a), "r"(b), "r"(c),
               "r"(d) : "memory");
}
__device__ __forceinline__ void dsv41c_sts64(const void* p, unsigned off, unsigned a, unsigned b) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(dsv41c_sbase(p) + off), "r"(a), "r"(b) : "memory");
}
// K-major operand, 128-byte swizzle: start address >> 4, leading offset unused (1), 1024 B between
// groups of 8 rows, layout type 1 (B128) in bits 62-63
__device__ __forceinline__ unsigned long long dsv41c_desc(const void* p, unsigned off) {
  return (unsigned long long)(((dsv41c_sbase(p) + off) & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32)
         | (1ull << 62);
}
__device__ __forceinline__ void dsv41c_fence_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void dsv41c_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void dsv41c_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void dsv41c_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
"""
# a float stored with an L2 evict-last policy (`_WG_WS_KEEP`)
_WS_KEEP_PRELUDE = """
__device__ __forceinline__ void dsv41c_st_keep(const float* p, float v) {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" :: "l"(p), "f"(v), "l"(pol) : "memory");
}
"""

# CUDA, sm_90: mbarriers at byte offset off of the wgmma kernel's shared memory; arrive releases
# and the wait acquires at CTA scope (the PTX defaults)
_MBAR_PRELUDE = """
__device__ __forceinline__ void dsv41c_mbar_init(const void* p, unsigned off, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(dsv41c_sbase(p) + off), "r"(count) : "memory");
}
__device__ __forceinline__ void dsv41c_mbar_arrive(const void* p, unsigned off) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(dsv41c_sbase(p) + off) : "memory");
}
__device__ __forceinline__ void dsv41c_mbar_wait(const void* p, unsigned off, unsigned parity) {
  asm volatile("{\\n.reg .pred done;\\nDSV41C_WAIT_%=:\\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n"
               "@!done bra DSV41C_WAIT_%=;\\n}" :: "r"(dsv41c_sbase(p) + off), "r"(parity) : "memory");
}
"""


class _WgLayout:
    """Byte offsets in the wgmma mixing kernel's shared memory (from the 1024-aligned base): fn^T's
    two pieces (the A operand), then two B tiles of h^T.  Both are K-major with the 128-byte
    swizzle: a 64-k block of an operand is its rows of 128 B, 8-row groups 1024 B apart, and the
    16-byte chunk c of row r sits at chunk c ^ (r % 8).  The methods take ints or TIR expressions
    (the kernel's and the tests' one definition)."""

    def __init__(self, m: int, W: int, BLK: int):
        self.steps = m * W // 16  # k steps of 16
        self.a_kb = 48 * 128  # one 64-k block of fn^T: 48 rows (the wgmma's rows 48-63 overlap the next)
        self.a_bytes = self.steps // 4 * self.a_kb + 2048  # + the last block's overlap
        self.b_kb = BLK * 128
        self.b_bytes = self.steps // 4 * self.b_kb
        self.smem = 1024 + self.a_bytes + 2 * self.b_bytes  # + the rounding up to 1024
        self.W = W

    def a(self, n, h, k):
        """The 8 bytes of piece h of coefficient n, k .. k + 3 (k a multiple of 4): row
        16 (n // 8) + 8 h + n % 8, so a thread's accumulator holds both pieces of its coefficient."""
        rho = 16 * (n // 8) + 8 * h + n % 8
        return k // 64 * self.a_kb + rho * 128 + ((k % 64 // 8) ^ (rho % 8)) * 16 + k % 8 // 4 * 8

    def b(self, buf, r, j, lane):
        """The 16 bytes of token row r, stream j, columns 8 lane .. 8 lane + 7 in B tile buf."""
        kb = j * (self.W // 64) + lane // 8
        return self.a_bytes + buf * self.b_bytes + kb * self.b_kb + r * 128 + ((lane % 8) ^ (r % 8)) * 16

    def a_step(self, st):
        """The A descriptor's start for k step st (32 bytes of each row a step)."""
        return st // 4 * self.a_kb + st % 4 * 32

    def b_step(self, buf, st):
        return self.a_bytes + buf * self.b_bytes + st // 4 * self.b_kb + st % 4 * 32


def _wgmma_fn(n: int) -> str:
    """`dsv41c_wgmma_n<n>(d, p, a_off, b_off, acc)`: one wgmma m64n<n>k16, bf16 operands from shared
    memory (descriptors at offsets a_off, b_off of `p`), fp32 accumulator d[0 : n / 2]; acc = 0
    overwrites d."""
    k = n // 2
    outs = ", ".join(f"%{i}" for i in range(k))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    return f"""
__device__ __forceinline__ void dsv41c_wgmma_n{n}(float* d, const void* p, unsigned a_off, unsigned b_off, int acc) {{
  unsigned long long da = dsv41c_desc(p, a_off), db = dsv41c_desc(p, b_off);
  asm volatile("{{\\n.reg .pred q;\\nsetp.ne.b32 q, %{k + 2}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, %{k}, %{k + 1}, q, 1, 1, 0, 0;\\n}}"
               : {cons} : "l"(da), "l"(db), "r"(acc) : "memory");
}}
"""


def _cuda_wg_prim_func(kind, m, D):
    """The column-resident wgmma mixing kernel for bf16 streams (module docstring, CUDA step 1).

    Grid (G = D / W column groups, P token groups), W = `_CR_W` = 256 columns of every stream per
    CTA; the CTA takes blocks of BLK = `_WG_BLK` tokens (bp, bp + P, ...).  BLK / `_WG_TPW`
    streaming warps, then one GEMM warpgroup; the two sides hand each block's B tile over through
    mbarriers (full: the streaming threads arrive after their stores; empty: the GEMM warpgroup
    arrives after the block's epilogue), so no streaming warp waits for another.
    - Streams: the flat kernel's access pattern.  A warp works on whole tokens, lane L on columns
      8L .. 8L + 7 of the CTA's group, so each warp-wide 16-byte access is the group's 512
      contiguous bytes of one row.  The streams are held as uint32 words of two bf16, h_new
      (post_pre) and x are formed in the reference's order, and the next block's streams (pre:
      the next two blocks', `_WG_AHEAD_PRE`) and coefficients are loaded while this one is
      computed (the coefficients reach shared memory after this block's compute, so no thread
      waits for them before its stream loads).  (Removed, timed no faster: the streams of the
      blocks 1, 2 or 4 beyond those in flight prefetched into L2; the first block's streams
      loaded before fn's slice; loads that skip L1 or are marked streaming, streaming stores; a
      third B tile; a layout under 164 KB of shared memory, BENCHMARKS.md.)
    - The mixes GEMM, transposed so the tokens are the wgmma's N and a block can be small:
      mixes^T [rows, BLK] = fn^T [rows, k] x h^T [k, BLK], k = m * W.  fn's slice stays in shared
      memory for every token the CTA sees, as the A operand (K-major, 128-byte swizzle) in two
      bf16 pieces (hi + mid, fn to about 2^-17 relative; the products are exact in fp32), piece h
      of coefficient n = 8w + g in row 16w + 8h + g, so one thread's accumulator holds both pieces
      of its coefficient (m = 4: 24 coefficients in 48 rows; the wgmma's rows 48-63 read the next
      k block's rows and are never used).  Each streaming warp writes its tokens' h_new into the
      block's B tile (K-major, 128-byte swizzle, two buffers), fences it for the async proxy and
      arrives at the tile's full mbarrier.
    - The GEMM warpgroup waits on that mbarrier, issues the block's 64 wgmma m64nBLKk16 (the k
      steps split over `_WG_KSPLIT` accumulators, each from zero, then added with IEEE adds: the
      tensor cores' own accumulation drifts over long k), waits for them, and writes the block's
      mixes and the streaming warps' sums of squares to the workspace [G, T, 32] for the finalize
      kernel, then arrives at the tile's empty mbarrier, on which the streaming warps wait before
      they write that tile again; so a B tile is written again only after its wgmma have
      completed.  setmaxnreg moves registers from the GEMM
      warpgroup (`_WG_GEMM_REGS`) to the streaming warps.  The wgmma and their waits sit in
      branches on a warp-uniform warpgroup index, and the epilogue reads every accumulator
      unconditionally: ptxas serialises every wgmma otherwise.
    The wgmma are issued through inline PTX (`_WGMMA_PRELUDE`): TileLang's T.gemm divides a GEMM
    over all the CTA's threads."""
    expand = kind == "post_pre"
    names = _PARAMS[kind, "main"]
    W, BLK, TPW, KS = _CR_W, _WG_BLK, _WG_TPW, _WG_KSPLIT
    AH = _WG_AHEAD_POST_PRE if expand else _WG_AHEAD_PRE  # blocks in flight
    NWp = BLK // TPW  # streaming warps
    nst = 32 * NWp
    gw = NWp // 4  # the GEMM warpgroup, after the streaming warps
    nth = nst + 128
    G = D // W
    S, N = _buffers(names, "bfloat16", m, D, G)
    mix = 2 * m + m * m
    L = _WgLayout(m, W, BLK)
    assert W == 256 and D % W == 0 and mix <= 24  # column_resident and the model's hc_mult <= 4
    if not (BLK % 8 == 0 and BLK % TPW == 0 and NWp >= 4 and NWp % 4 == 0 and L.steps % KS == 0 and AH >= 1):
        raise ValueError(f"mHC wgmma kernel tuning: _WG_BLK={BLK}, _WG_TPW={TPW}, _WG_KSPLIT={KS}, blocks in "
                         f"flight {AH}: needs _WG_BLK a multiple of 8 and of _WG_TPW, "
                         f"_WG_BLK / _WG_TPW streaming warps a multiple of 4, _WG_KSPLIT dividing the {L.steps} k "
                         f"steps, at least one block in flight")
    # registers per thread with a GEMM warpgroup: the launch's share, then _WG_GEMM_REGS for the
    # GEMM warpgroup and the rest to the streaming warps (setmaxnreg), a multiple of 8 up to 248
    r0 = min(255, 65536 // nth) // 8 * 8
    r_st = min(248, (r0 * nth - 128 * _WG_GEMM_REGS) // nst // 8 * 8)
    ncf = (m + m * m if expand else 0) + m  # per-token coefficients: post, comb, pre_delayed
    rows = list(range(m + 1 if expand else m))
    src = "RES" if expand else "H"
    pmax = max(1, _CR_WAVES * _SMS // G)
    nfv = mix * m * W // 4  # float4 vectors of fn's slice
    # the coefficients a fetch shares out: a warp's own tokens' over its lanes, ncv a lane
    ncoef = TPW * ncf
    ncv = -(-ncoef // 32)
    mb = L.a_bytes + 2 * L.b_bytes  # the mbarriers full[0], full[1], empty[0], empty[1], 8 bytes each
    mul, add = _arith(True)
    prelude = (cuda_trace_prelude(_TRACE, TRACE_SLOTS, _TRACE_SM) if _TRACE else "") + \
        CUDA_PACK_BF16X2 + _RUNNING_ADDRS + _WGMMA_PRELUDE + _MBAR_PRELUDE + _wgmma_fn(BLK) + \
        (_WS_KEEP_PRELUDE if _WG_WS_KEEP else "") + "".join(
        f"""
__device__ __forceinline__ void dsv41c_setmaxnreg_{op}{r}() {{ asm volatile("setmaxnreg.{op}.sync.aligned.u32 {r};"); }}
""" for op, r in (("dec", _WG_GEMM_REGS), ("inc", r_st)))
    nacc = BLK // 2  # accumulator registers of one wgmma
    row_bytes = D * 2  # one token's row of one bf16 stream
    sets = list(range(AH + 1))  # the register sets (a list: unrolled at trace time)

    @T.macro
    def load_streams(X, blk, q, si, ra):
        """The warp's tokens of block blk, the lane's four words of each row, into register set si
        of X, from the running load addresses ra[0] (the streams) and ra[1] (y) at block blk, which
        then step to the next.  A token past N is not loaded: it keeps stale words, but its h_new,
        x, column of the B tile and mixes are never stored, and a GEMM column depends on its own
        token alone."""
        for u in T.unroll(TPW):
            if blk * BLK + q * TPW + u < N:
                for j in rows:
                    T.call_extern("handle", "dsv41c_ldg128", ra[1] if j == m else ra[0],
                                  u * row_bytes if j == m else u * m * row_bytes + j * row_bytes,
                                  T.address_of(X[si, u, j, 0]))
        ra[0] = ra[0] + ra[5]
        if expand:
            ra[1] = ra[1] + ra[4]

    def coef_index(v, tx):
        """Element v of streaming thread tx's share of its warp's tokens' coefficients (row-major,
        ncf a token)."""
        return v * 32 + tx % 32

    def coef_row(v, tx):
        """The token row (in the block) of that element."""
        return coef_index(v, tx) // ncf + tx // 32 * TPW

    @T.macro
    def fetch_coefs(B, cv, blk, tx):
        """Block blk's per-token coefficients into cv: streaming thread tx's share of its own
        warp's tokens'."""
        for v in T.unroll(ncv):
            e = coef_index(v, tx)
            k = e % ncf
            t = blk * BLK + coef_row(v, tx)
            ok = (t < N) & (e < ncoef)
            if expand:
                cv[v] = T.if_then_else(
                    ok, T.if_then_else(
                        k < m, B["PIN"][T.min(t, N - 1), T.min(k, m - 1)], T.if_then_else(
                            k < m + m * m, B["CIN"][T.min(t, N - 1), T.max(k - m, 0) // m % m, T.max(k - m, 0) % m],
                            B["PD"][T.min(t, N - 1), T.max(k - m - m * m, 0) % m])), T.float32(0))
            else:
                cv[v] = T.if_then_else(ok, B["PD"][T.min(t, N - 1), k], T.float32(0))

    @T.macro
    def stash_coefs(Cos, buf, cv, tx):
        for v in T.unroll(ncv):
            if coef_index(v, tx) < ncoef:
                Cos[buf, coef_row(v, tx), coef_index(v, tx) % ncf] = cv[v]
        T.call_extern("handle", "__syncwarp")  # the warp's own rows, read by its lanes alone

    @T.macro
    def compute(R, blk, buf, X, q, lane, sm, si):
        """The warp's tokens of block blk from register set si of X: h_new and x stored (at the
        running store addresses ra[2] (x) and ra[3] (h_new), which then step to the next block),
        h_new into B tile buf, squares into SQ."""
        Cos, SQ, ol, xo, hf, xf, hv, sq = R["Cos"], R["SQ"], R["ol"], R["xo"], R["hf"], R["xf"], R["hv"], R["sq"]
        for u in T.unroll(TPW):
            r = q * TPW + u
            t = blk * BLK + r
            sq[0] = T.float32(0)
            for w in T.unroll(4):
                if expand:
                    for h in [0, 1]:
                        for j, hj in enumerate(_expand_exprs(
                                m, lambda coef: Cos[buf, r, coef],  # noqa: B023
                                lambda src_row: _bf16_half(X[si, u, src_row, w], h),  # noqa: B023
                                mul, add)):
                            hf[j, h] = hj
                    for j in T.unroll(m):
                        ol[j, w] = T.call_extern("uint32", "dsv41c_pack_bf16x2", hf[j, 0], hf[j, 1])
                else:
                    for j in T.unroll(m):
                        ol[j, w] = X[si, u, j, w]
                for h in [0, 1]:
                    for j in T.unroll(m):
                        hv[j] = _bf16_half(ol[j, w], h)
                    xf[h] = _collapse_expr(m, lambda pd_j: Cos[buf, r, ncf - m + pd_j], hv, mul, add)  # noqa: B023
                    for j in T.unroll(m):
                        sq[0] = sq[0] + hv[j] * hv[j]
                xo[w] = T.call_extern("uint32", "dsv41c_pack_bf16x2", xf[0], xf[1])
            if t < N:
                T.call_extern("handle", "dsv41c_stg128", R["ra"][2], u * row_bytes, T.address_of(xo[0]))
                if expand:
                    for j in T.unroll(m):
                        T.call_extern("handle", "dsv41c_stg128", R["ra"][3], u * m * row_bytes + j * row_bytes,
                                      T.address_of(ol[j, 0]))
            for j in T.unroll(m):
                T.call_extern("handle", "dsv41c_sts128", sm, L.b(buf, r, j, lane),
                              ol[j, 0], ol[j, 1], ol[j, 2], ol[j, 3])
            for o in [16, 8, 4, 2, 1]:
                sq[0] = sq[0] + T.shfl_xor(sq[0], o)
            if lane == 0:
                SQ[buf, r] = sq[0]
        R["ra"][2] = R["ra"][2] + R["ra"][4]
        if expand:
            R["ra"][3] = R["ra"][3] + R["ra"][5]

    @T.macro
    def store_ws(B, g, t, n, v):
        """Entry n of token t's row of column group g in the workspace (`_WG_WS_KEEP`: evict-last)."""
        if _WG_WS_KEEP:
            T.call_extern("handle", "dsv41c_st_keep", T.address_of(B["WS"][g, t, n]), v)
        else:
            B["WS"][g, t, n] = v

    @T.macro
    def epilogue(B, R, blk, buf, tx, bg):
        """Block blk's mixes from the accumulators (hi + mid rows of the thread's coefficient), and
        its sums of squares, to the workspace (the GEMM warpgroup, tx its thread index in it, after
        the block's wgmma have completed).
        Every thread of the warpgroup reads all its accumulators, unconditionally: a read in a
        divergent branch makes ptxas serialise every wgmma."""
        acc, tot, SQ = R["acc"], R["tot"], R["SQ"]
        w, lane = tx // 32, tx % 32
        n = 8 * w + lane // 4
        for jt in T.unroll(BLK // 8):
            for e in T.unroll(2):
                tot[jt * 2 + e] = acc[4 * jt + e]
                for ks in T.unroll(1, KS):
                    tot[jt * 2 + e] = tot[jt * 2 + e] + acc[ks * nacc + 4 * jt + e]
                for ks in T.unroll(KS):
                    tot[jt * 2 + e] = tot[jt * 2 + e] + acc[ks * nacc + 4 * jt + 2 + e]
        if n < mix:
            for jt in T.unroll(BLK // 8):
                for e in T.unroll(2):
                    t = blk * BLK + 8 * jt + 2 * (lane % 4) + e
                    if t < N:
                        store_ws(B, bg, t, n, tot[jt * 2 + e])
        if tx < BLK:
            if blk * BLK + tx < N:
                store_ws(B, bg, blk * BLK + tx, mix, SQ[buf, tx])

    @T.macro
    def stream_block(B, R, i, blk, nb, PV, X, cv, q, lane, tx, sm, si):
        """Block number i (blk) of the CTA's blocks, by the streaming warps: up to the B tile's
        stores and the next block's coefficients stashed.  Block i's streams are in register set
        si of X, and block i + AH's go into set (si + AH) % (AH + 1), the one block i - 1 was
        computed from.  The B tile and SQ are handed to the GEMM warpgroup through mbarriers, so
        no streaming warp waits for another: before block i's stores into B tile buf and SQ, the
        GEMM warpgroup is done with block i - 2 (empty[buf]'s completion number i // 2 - 1); after
        them, and after its warp's next coefficients are stashed, each thread arrives at
        full[buf]."""
        buf = i % 2
        if i + AH < nb:
            load_streams(X, blk + AH * PV, q, (si + AH) % (AH + 1), R["ra"])
        if i + 1 < nb:
            fetch_coefs(B, cv, blk + PV, tx)
        if i >= 2:
            T.call_extern("handle", "dsv41c_mbar_wait", sm, mb + 16 + 8 * buf, (i // 2 + 1) % 2)
        # (no name bound to the buffer: the script parser would rename it in the CUDA source)
        compute(R, blk, buf, X, q, lane, sm, si)
        T.call_extern("handle", "dsv41c_fence_async")  # the B tile's stores, for the wgmma
        stash_coefs(R["Cos"], 1 - buf, cv, tx)
        T.call_extern("handle", "dsv41c_mbar_arrive", sm, mb + 8 * buf)

    @T.macro
    def issue(R, buf, sm):
        acc = R["acc"]
        T.call_extern("handle", "dsv41c_wgmma_fence")
        for ks in T.unroll(KS):
            for s in T.unroll(L.steps // KS):
                st = ks * (L.steps // KS) + s
                T.call_extern("handle", f"dsv41c_wgmma_n{BLK}", T.address_of(acc[ks * nacc]), sm,
                              L.a_step(st), L.b_step(buf, st),
                              0 if s == 0 else 1)
        T.call_extern("handle", "dsv41c_wgmma_commit")

    mark, mark_first = trace_macros(bool(_TRACE))

    @T.macro
    def body(B):
        with T.Kernel(G, T.min(T.ceildiv(N, BLK), pmax), threads=nth, prelude=prelude) as (bg, bp):
            tx = T.get_thread_binding()
            mark(0, timer=_TRACE_T0)
            TCU.pdl_trigger()  # the finalize kernel may launch once every CTA of this one has started
            SMB = T.alloc_shared((L.smem // 4 + 8,), "uint32")  # + the four mbarriers
            Cos = T.alloc_shared((2, BLK, ncf), "float32")
            SQ = T.alloc_shared((2, BLK), "float32")
            fv = T.alloc_local((4,), "float32")
            hp = T.alloc_local((4,), "float32")
            X = T.alloc_local((AH + 1, TPW, len(rows), 4), "uint32")  # a set per block in flight, and one computed
            ol = T.alloc_local((m, 4), "uint32")
            xo = T.alloc_local((4,), "uint32")
            hf = T.alloc_local((m, 2), "float32")
            xf = T.alloc_local((2,), "float32")
            hv = T.alloc_local((m,), "float32")
            sq = T.alloc_local((1,), "float32")
            cv = T.alloc_local((ncv,), "float32")
            acc = T.alloc_local((KS * nacc,), "float32")
            tot = T.alloc_local((BLK // 4,), "float32")
            # the next block's load addresses (streams, y), this block's store addresses (x, h_new),
            # at the warp's first token and the lane's first word; the bytes one token row of x (and
            # m rows) moves over a step of the CTA's blocks
            ra = T.alloc_local((6,), "uint64")
            for k in T.unroll(KS * nacc):
                acc[k] = T.float32(0)
            # the thread's warpgroup, as a value ptxas knows is warp-uniform: the wgmma and their
            # waits sit in branches on it
            wg = T.call_extern("int32", "__shfl_sync", T.uint32(0xFFFFFFFF), tx // 128, 0)
            sm = T.address_of(SMB[0])
            # fn's slice -> fn^T's two bf16 pieces, the A operand
            for it in T.unroll(-(-nfv // nth)):
                v = it * nth + tx
                if v < nfv:
                    n = v // (m * W // 4)
                    j = v // (W // 4) % m
                    col = v % (W // 4) * 4
                    for e in T.vectorized(4):
                        fv[e] = B["FN"][n, j * D + bg * W + col + e]
                    for e in T.unroll(4):
                        hp[e] = T.Cast("float32", T.Cast("bfloat16", fv[e]))
                    k = j * W + col
                    T.call_extern("handle", "dsv41c_sts64", sm, L.a(n, 0, k),
                                  T.call_extern("uint32", "dsv41c_pack_bf16x2", hp[0], hp[1]),
                                  T.call_extern("uint32", "dsv41c_pack_bf16x2", hp[2], hp[3]))
                    T.call_extern("handle", "dsv41c_sts64", sm, L.a(n, 1, k),
                                  T.call_extern("uint32", "dsv41c_pack_bf16x2", fv[0] - hp[0], fv[1] - hp[1]),
                                  T.call_extern("uint32", "dsv41c_pack_bf16x2", fv[2] - hp[2], fv[3] - hp[3]))
            q = tx // 32
            lane = tx % 32
            NB = T.ceildiv(N, BLK)
            PV = T.min(NB, pmax)
            nb = T.ceildiv(NB - bp, PV)
            cw = bg * (W // 2) + lane * 4  # the lane's first word of each row
            R = {"Cos": Cos, "SQ": SQ, "ol": ol, "xo": xo, "hf": hf, "xf": xf, "hv": hv, "sq": sq, "acc": acc,
                 "tot": tot, "ra": ra}
            t0 = bp * BLK + q * TPW
            # (byte offsets from each buffer's base: token t0, the lane's first word cw of 4 bytes;
            # seeing no store to x or h_new, TileLang declares them const: they are stored by PTX)
            tb = T.Cast("uint64", t0) * T.uint64(row_bytes)
            cb = T.Cast("uint64", cw * 4)
            ra[0] = T.call_extern("uint64", "dsv41c_addr", B[src].data) + tb * T.uint64(m) + cb
            ra[2] = T.call_extern("uint64", "dsv41c_addr", B["X"].data) + tb + cb
            if expand:
                ra[1] = T.call_extern("uint64", "dsv41c_addr", B["Y"].data) + tb + cb
                ra[3] = T.call_extern("uint64", "dsv41c_addr", B["HN"].data) + tb * T.uint64(m) + cb
            ra[4] = T.Cast("uint64", PV) * T.uint64(BLK * row_bytes)
            ra[5] = ra[4] * T.uint64(m)
            if tx < nst:
                fetch_coefs(B, cv, bp, tx)
                stash_coefs(Cos, 0, cv, tx)
                for k in sets[:-1]:
                    load_streams(X, bp + k * PV, q, k, ra)
            if tx == 0:
                for b in range(2):
                    T.call_extern("handle", "dsv41c_mbar_init", sm, mb + 8 * b, nst)
                    T.call_extern("handle", "dsv41c_mbar_init", sm, mb + 16 + 8 * b, 128)
            T.call_extern("handle", "dsv41c_fence_async")
            T.sync_threads()  # fn^T in place; the first block's coefficients
            mark(1)
            if wg == gw:  # the GEMM warpgroup: each block's wgmma, as soon as its B tile is written
                if r_st > r0:
                    T.call_extern("handle", f"dsv41c_setmaxnreg_dec{_WG_GEMM_REGS}")
                for i in T.serial(nb):
                    # block i's B tile, squares: full[i % 2]'s completion number i // 2
                    T.call_extern("handle", "dsv41c_mbar_wait", sm, mb + 8 * (i % 2), i // 2 % 2)
                    issue(R, i % 2, sm)
                    T.call_extern("handle", "dsv41c_wgmma_wait")
                    epilogue(B, R, bp + i * PV, i % 2, tx - 128 * gw, bg)
                    T.call_extern("handle", "dsv41c_mbar_arrive", sm, mb + 16 + 8 * (i % 2))
                    mark_first(i, 20 + i, _TRACE_GEMM_BLOCKS, 128 * gw)
                mark(3, 128 * gw, _TRACE_T1)
            else:
                if r_st > r0:
                    T.call_extern("handle", f"dsv41c_setmaxnreg_inc{r_st}")
                for i3 in T.serial(T.ceildiv(nb, AH + 1)):  # unrolled by the sets: each block's set is static
                    for si in sets:
                        if i3 * (AH + 1) + si < nb:
                            stream_block(B, R, i3 * (AH + 1) + si, bp + (i3 * (AH + 1) + si) * PV, nb, PV, X, cv,
                                         q, lane, tx, sm, si)
                            mark_first(i3 * (AH + 1) + si, 4 + i3 * (AH + 1) + si, _TRACE_STREAM_BLOCKS)
                mark(2)

    return names, _prim_func(names, S, body).with_attr(NO_SYNC_ATTR, 1)


# CUDA, the finalize's quotients by one divisor (a row's or a column's sum, + eps in the Sinkhorn)
# through one shared reciprocal.  dsv41c_rcp and dsv41c_div are the instructions of div.rn's fast
# path as nvcc emits it for sm_90 (MUFU.RCP, two FFMA refine the reciprocal, then per quotient a
# product and one FFMA correction), so each quotient is the IEEE one wherever div.rn takes that
# path: a normal divisor and a quotient that neither overflows nor falls below the normal range.
# The divisors here are at least 1 (the softmax's sum of exponentials) or hc_eps, and the Sinkhorn's
# entries stay near hc_eps and above; only a softmax term e^(x - max) / sum may be subnormal, and
# the + hc_eps after it absorbs any last-bit difference.  A NaN propagates.
_DIV_PRELUDE = r"""
__device__ __forceinline__ float dsv41c_rcp(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
}
__device__ __forceinline__ float dsv41c_div(float c, float d, float r) {
  float q = __fmul_rn(c, r);
  return __fmaf_rn(r, __fmaf_rn(-d, q, c), q);
}
"""


def _tree_sum(vals):
    """Pairwise sum in the order of an xor butterfly over len(vals) (a power of two) lanes."""
    while len(vals) > 1:
        vals = [vals[k] + vals[k + 1] for k in range(0, len(vals), 2)]
    return vals[0]


def _cuda_finalize_prim_func(m, D, norm_eps, hc_eps, iters, splits=None):
    """mp lanes per token (module docstring, CUDA step 2; mp = m rounded up to a power of two):
    lane i holds row i of comb (lanes i >= m hold zeros), pre[i] and post[i], and the sum of
    squares, read from the CTA's shared rows of the workspace's K partial sums.  A row's sums are a
    pairwise tree in the lane, a column's an xor butterfly over the token's lanes; the quotients by
    one sum share its reciprocal (`_DIV_PRELUDE`)."""
    names = _PARAMS["finalize", "main"]
    fixed = splits is not None
    splits = splits if fixed else T.dynamic("K")
    S, N = _buffers(names, "float32", m, D, splits)
    ks = functools.partial(T.unroll, 1, splits) if fixed else functools.partial(T.serial, 1, splits)
    mix = 2 * m + m * m
    mp = 1 << (m - 1).bit_length()
    lanes = [1 << b for b in range(mp.bit_length() - 1)]  # xor offsets over the token's lanes (i)
    cols = list(range(m))  # (a list: unrolled at trace time)
    threads = 128
    tpc = threads // mp  # tokens per CTA
    assert _NPAD == 32 and _FIN_ROW >= _NPAD  # a workspace row: 8 lanes of 4 floats
    eps = _f32_const(hc_eps)

    def zero_padded(c):
        return [c[j] for j in cols] + [T.float32(0)] * (mp - m)

    def ws_row(bx, tx, N, g):
        """The workspace row that thread tx of CTA bx reads in pass g (a row past N reads row N - 1,
        which is not stored: no branch between the loads)."""
        return T.min(bx * tpc + g * (threads // 8) + tx // 8, N - 1)

    @T.macro
    def body(B):
        with T.Kernel(T.ceildiv(N * mp, threads), threads=threads, prelude=_DIV_PRELUDE) as bx:
            tx = T.get_thread_binding()
            TCU.pdl_sync()  # launched early (programmatic launch): wait for the mixing kernel's workspace
            t = bx * tpc + tx // mp
            i = tx % mp
            c = T.alloc_local((m,), "float32")  # row i of comb
            d = T.alloc_local((m,), "float32")  # each column's sum + eps
            v = T.alloc_local((3,), "float32")  # pre[i], post[i], the sum of squares
            r = T.alloc_var("float32")
            s = T.alloc_var("float32")
            for j in cols:
                c[j] = T.float32(0)
            for u in [0, 1, 2]:
                v[u] = T.float32(0)
            # the K partial sums of the CTA's tokens' rows by 8 lanes a row (a 16-byte vector of
            # the row's 32 floats each, all K loads of a lane independent), in order, into S;
            # then each lane reads its own from S
            S = T.alloc_shared((tpc, _FIN_ROW), "float32")
            npass = tpc * 8 // threads  # the CTA's rows, in passes of threads / 8
            fly = min(2, npass)  # the rows a lane has in flight, all their K loads
            a = T.alloc_local((fly, 4), "float32")
            w = T.alloc_local((fly, 4), "float32")
            for g0 in range(0, npass, fly):
                for p in T.unroll(fly):
                    for e in T.vectorized(4):
                        a[p, e] = B["WS"][0, ws_row(bx, tx, N, g0 + p), tx % 8 * 4 + e]
                for k in ks():
                    for p in T.unroll(fly):
                        for e in T.vectorized(4):
                            w[p, e] = B["WS"][k, ws_row(bx, tx, N, g0 + p), tx % 8 * 4 + e]
                        for e in T.unroll(4):
                            a[p, e] = a[p, e] + w[p, e]
                for p in T.unroll(fly):
                    tl = (g0 + p) * (threads // 8) + tx // 8
                    if bx * tpc + tl < N:
                        for e in T.unroll(4):
                            S[tl, tx % 8 * 4 + e] = a[p, e]
            T.sync_threads()
            if t < N:
                v[2] = S[tx // mp, mix]
                if i < m:
                    for j in cols:
                        c[j] = S[tx // mp, 2 * m + i * m + j]
                    v[0] = S[tx // mp, i]
                    v[1] = S[tx // mp, m + i]
            r = T.float32(1) / T.sqrt(v[2] / T.float32(m * D) + _f32_const(norm_eps))
            if T.And(t < N, i < m):
                B["PRE"][t, i] = T.sigmoid(v[0] * r * B["SC"][0] + B["BASE"][i]) + eps
                B["POST"][t, i] = T.float32(2) * T.sigmoid(v[1] * r * B["SC"][1] + B["BASE"][m + i])
            # row softmax, then + eps (lanes past the matrix: zeros throughout)
            if i < m:
                for j in cols:
                    c[j] = c[j] * r * B["SC"][2] + B["BASE"][2 * m + i * m + j]
                s = c[0]
                for j in cols[1:]:
                    s = T.max(s, c[j])
                for j in cols:
                    c[j] = T.exp(c[j] - s)
                s = _tree_sum(zero_padded(c))
                r = T.call_extern("float32", "dsv41c_rcp", s)
                for j in cols:
                    c[j] = T.call_extern("float32", "dsv41c_div", c[j], s, r) + eps
            # column, then (row, column) x (iters - 1): c /= (its column's or row's sum + eps)
            for it in T.serial(iters):
                if it > 0:
                    s = _tree_sum(zero_padded(c)) + eps
                    r = T.call_extern("float32", "dsv41c_rcp", s)
                    for j in cols:
                        c[j] = T.call_extern("float32", "dsv41c_div", c[j], s, r)
                for j in cols:
                    d[j] = c[j]
                    for o in lanes:
                        d[j] = d[j] + T.shfl_xor(d[j], o)
                    d[j] = d[j] + eps
                for j in cols:
                    c[j] = T.call_extern("float32", "dsv41c_div", c[j], d[j],
                                         T.call_extern("float32", "dsv41c_rcp", d[j]))
            if T.And(t < N, i < m):
                for j in cols:
                    B["COMB"][t, i, j] = c[j]

    return names, _prim_func(names, S, body)
