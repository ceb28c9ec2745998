"""Sparse attention with a sink (MODEL.md §6.8): TileLang kernels over plain or packed KV rows.

Ops (`torch.ops.dsv41c.*`); q [B,S,H,d] fp32 or bf16, sink [H] fp32, idx [B,S,K] int32 (-1 = none):
  sparse_attn(q, kv, sink, idx, scale)
      kv [B,N,d] rows in q's dtype, both keys and values            -> o [B,S,H,d] in q's dtype
  sparse_attn_packed(q, window, window_scales, comp_codes, comp_scales, sink, idx, scale)
      the list addresses cat(window rows, compressed rows): t < n_w is window row t, t >= n_w is
      compressed row t - n_w.  window: rows [B,n_w,d] in q's dtype with window_scales None (prefill:
      the chunk's fresh rows), or FP8 E4M3 codes u8 [B,n_w,d] with UE8M0 scales u8 [B,n_w,d/32]
      (decode: the ring).  Compressed rows: packed E2M1 u8 [B,n_c,d/2] with E4M3 scales u8
      [B,n_c,d/16] (`dsv41c/cache.py` RowStore layouts).  The kernels dequantise each listed row
      into the tile they compute on; the dequantised cache never exists in memory.
The references are `sparse_attn_ref` (= `dsv41c.attention.sparse_attn`) and `sparse_attn_packed_ref`.
Entries >= the number of rows are ignored like -1 (the references raise on them).

Numerics, both targets (the official kernel's, §6.8): l = (q . k) with fp32 accumulation, times
scale; online softmax over the list in blocks of 64 entries, running max seeded at -1e30, fp32
running max and sum; p = exp(l - m_running) joins the sum in fp32 and the value product rounded
to bf16 for bf16 inputs (fp32 inputs: p unrounded, so the online form is the exact softmax up to
fp32 rounding); o = acc / (sum + exp(sink - m)) in q's dtype.  A query with no valid entry gets 0.
Dequantised FP8 and FP4 values are exact in bf16 and fp32, so packed rows enter the products as the
same numbers the reference gathers.  Differences from the reference: the dot products' summation
order and expf vs torch's exp (fp32 rounding), which can move a bf16 rounding of p or of o by one
ulp; the tests bound that.

CPU (C target): one program per query token (grid S x B); per block of 64 entries the listed rows
are gathered (dequantised) into an fp32 local tile [64, d], then every head computes its logits,
updates its running max/sum and accumulates p . rows into acc [H, d] (fp32, local).  bf16 travels
as uint16 bits.  One build per (kind, dtype, H, d, scale, target); B, S, K and the row counts are
dynamic.

CUDA (sm_90a, wgmma through T.gemm): grid (S, B, H / HB); a CTA of 256 threads (two warpgroups)
owns HB heads of one query token.  q [HB, d] sits in shared memory as bf16.  Per block of 64 list
entries the CTA puts the 64 row numbers into shared memory (loaded during the previous block's
GEMMs), then gathers the rows into shared memory as bf16 [64, d]: each thread first issues all its
loads (16 items of 8 values: 16 B of bf16, 8 B of FP8 codes or 4 B of packed E2M1, plus the scale
byte), then decodes them (each item becomes one 16-byte bf16 vector) and stores them, so the
gather costs one memory latency (two rounds of 8 items for bf16 window rows with FP4 rows, whose
registers would not fit beside the accumulator).  Then S = q K^T [HB, 64] (fp32 accumulation)
and acc += bf16(p) V [HB, d] on the tensor cores.  KV is shared by all heads (MQA), so one
gathered tile serves every head of the CTA.  HB = 64 heads is one wgmma M (fewer heads: zero
rows, not stored); the fp32 accumulator [64, 512] is 128 registers per thread; 141 KB of shared
memory, one CTA per SM.  The list is walked in order by one CTA, which keeps the reference's
rounding of p exactly (a split of the list over CTAs would round p against a partial running
max).  Only bf16 runs on CUDA (the tensor cores take bf16 operands; an fp32 call raises).
"""

import functools

import tilelang.cpu.language as TC
import tilelang.language as T
import torch

from dsv41c import quant as Q
from dsv41c.attention import sparse_attn as sparse_attn_ref
from dsv41c.tilelang_kernels.quant import (_bits, _e2m1_value, _e4m3_value, _e8m0_value, _store, compile_for,
                                            define_op, kernel_target)

__all__ = ["BLOCK", "KINDS", "build", "attention_prim_func", "sparse_attn", "sparse_attn_packed",
           "sparse_attn_packed_ref", "sparse_attn_ref"]

BLOCK = 64  # list entries per online-softmax step (§6.8)
KINDS = ("plain", "packed_rows", "packed_fp8")  # kv rows; packed with a plain window; packed with an FP8 ring
_CUDA_THREADS = 256
_CUDA_HEADS = 64  # heads per CTA (one wgmma M)
# CUDA: rounds of loads per gathered block; one round keeps 16 items of raw bytes in registers, which
# fits beside the accumulator except for bf16 window rows plus FP4 rows (that build spills at d=512)
_GATHER_GROUPS = {"plain": 1, "packed_rows": 2, "packed_fp8": 1}
_NEG_BIG = -1e30


# ------------------------------------------------------------------------------------- refs

def sparse_attn_packed_ref(q, window, window_scales, comp_codes, comp_scales, sink, idx, scale):
    """sparse_attn over cat(window rows, fp4_e4m3 dequant of the compressed rows): what
    `sparse_attn_packed` computes.  window_scales None: window holds rows in q's dtype; else window
    holds FP8 codes with UE8M0 scales."""
    rows = window if window_scales is None else Q.fp8_dequant_ref(window, window_scales, q.dtype)
    comp = Q.fp4_e4m3_dequant_ref(comp_codes, comp_scales, q.dtype)
    return sparse_attn_ref(q, torch.cat([rows.to(q.dtype), comp], dim=1), sink, idx, scale)


# ------------------------------------------------------------------------------------- shared TIR

def _f32_bits(v: float) -> int:
    return torch.tensor(v, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def _f32_const(v: float):
    """An fp32 constant entered by its bits: the C codegen prints floats with 7 digits."""
    return T.reinterpret(T.uint32(_f32_bits(v)), "float32")


def _ld(v):
    """fp32 value of an element of an fp32, bf16 or uint16-holding-bf16 buffer."""
    if str(v.dtype) == "float32":
        return v
    return T.reinterpret(_bits(v), "float32")


def _fp8_value(code, scale_byte):
    return _e4m3_value(T.Cast("uint32", code)) * _e8m0_value(T.Cast("uint32", scale_byte))


def _fp4_value(packed, c, scale_byte):
    """Element c of a packed E2M1 row (2i low nibble, 2i+1 high nibble) times its E4M3 scale."""
    byte = T.Cast("uint32", packed)
    nib = T.Select(c % 2 == 0, byte & T.uint32(0xF), byte >> T.uint32(4))
    return _e2m1_value(nib) * _e4m3_value(T.Cast("uint32", scale_byte))


def _dims():
    return {n: T.dynamic(n) for n in ("B", "S", "K", "N", "NC")}


# ------------------------------------------------------------------------------------- C target

def _cpu_load_macro(kind, d, N):
    """Macro writing listed row t (fp32 values) into rows[i, :]; R maps buffer names to buffers."""
    @T.macro
    def load_comp(R, rows, i, b, t):
        for c in T.serial(d):
            rows[i, c] = _fp4_value(R["CC"][b, t - N, c // 2], c, R["CS"][b, t - N, c // 16])

    if kind == "plain":
        @T.macro
        def load(R, rows, i, b, t):
            for c in T.serial(d):
                rows[i, c] = _ld(R["KV"][b, t, c])
    elif kind == "packed_rows":
        @T.macro
        def load(R, rows, i, b, t):
            if t < N:
                for c in T.serial(d):
                    rows[i, c] = _ld(R["W"][b, t, c])
            else:
                load_comp(R, rows, i, b, t)
    else:
        @T.macro
        def load(R, rows, i, b, t):
            if t < N:
                for c in T.serial(d):
                    rows[i, c] = _fp8_value(R["W"][b, t, c], R["WS"][b, t, c // 32])
            else:
                load_comp(R, rows, i, b, t)
    return load


def _cpu_prim_func(kind, dtype, H, d, scale):
    vt = "uint16" if dtype == "bfloat16" else "float32"
    D = _dims()
    B, S, K, N, NC = D["B"], D["S"], D["K"], D["N"], D["NC"]
    rows_total = N if kind == "plain" else N + NC
    rnd = dtype == "bfloat16"
    load = _cpu_load_macro(kind, d, N)

    @T.macro
    def attend(R, b, s):
        rows = T.alloc_local((BLOCK, d), "float32")
        ok = T.alloc_local((BLOCK,), "int32")
        lg = T.alloc_local((BLOCK,), "float32")
        pr = T.alloc_local((BLOCK,), "float32")
        acc = T.alloc_local((H, d), "float32")
        mrun = T.alloc_local((H,), "float32")
        den = T.alloc_local((H,), "float32")
        qf = T.alloc_local((d,), "float32")
        t = T.alloc_var("int32")
        mx = T.alloc_var("float32")
        alpha = T.alloc_var("float32")
        psum = T.alloc_var("float32")
        dot = T.alloc_var("float32")
        T.clear(acc)
        T.clear(den)
        for h in T.serial(H):
            mrun[h] = _f32_const(_NEG_BIG)
        for blk in T.serial(T.ceildiv(K, BLOCK)):
            for i in T.serial(BLOCK):
                t = -1
                if blk * BLOCK + i < K:
                    t = R["IDX"][b, s, blk * BLOCK + i]
                ok[i] = T.Select(t >= 0, T.Select(t < rows_total, 1, 0), 0)
                if ok[i] == 1:
                    load(R, rows, i, b, t)
            for h in T.serial(H):
                for c in T.serial(d):
                    qf[c] = _ld(R["Q"][b, s, h, c])
                mx = mrun[h]
                for i in T.serial(BLOCK):
                    if ok[i] == 1:
                        dot = T.float32(0)
                        for c in T.serial(d):
                            dot = dot + qf[c] * rows[i, c]
                        lg[i] = dot * _f32_const(scale)
                        mx = T.max(mx, lg[i])
                alpha = T.exp(mrun[h] - mx)
                psum = T.float32(0)
                for i in T.serial(BLOCK):
                    pr[i] = T.float32(0)
                    if ok[i] == 1:
                        pr[i] = T.exp(lg[i] - mx)
                        psum = psum + pr[i]
                        if rnd:
                            pr[i] = T.reinterpret(_bits(_store("uint16", pr[i])), "float32")
                den[h] = den[h] * alpha + psum
                for c in T.serial(d):
                    dot = acc[h, c] * alpha
                    for i in T.serial(BLOCK):
                        if ok[i] == 1:
                            dot = dot + pr[i] * rows[i, c]
                    acc[h, c] = dot
                mrun[h] = mx
        for h in T.serial(H):
            alpha = den[h] + T.exp(R["SINK"][h] - mrun[h])
            for c in T.serial(d):
                R["O"][b, s, h, c] = _store(vt, acc[h, c] / alpha)

    qt, ot = T.Tensor((B, S, H, d), vt), T.Tensor((B, S, H, d), vt)
    st, it = T.Tensor((H,), "float32"), T.Tensor((B, S, K), "int32")
    ct, cst = T.Tensor((B, NC, d // 2), "uint8"), T.Tensor((B, NC, d // 16), "uint8")

    if kind == "plain":
        @T.prim_func
        def main(Q_: qt, KV: T.Tensor((B, N, d), vt), SINK: st, IDX: it, O: ot):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "KV": KV, "SINK": SINK, "IDX": IDX, "O": O}, b, s)
    elif kind == "packed_rows":
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), vt), CC: ct, CS: cst, SINK: st, IDX: it, O: ot):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "W": W, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O}, b, s)
    else:
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), "uint8"), WS: T.Tensor((B, N, d // 32), "uint8"), CC: ct,
                 CS: cst, SINK: st, IDX: it, O: ot):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "W": W, "WS": WS, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O},
                       b, s)
    return main


# ------------------------------------------------------------------------------------- CUDA

def _cuda_prim_func(kind, H, d, scale):
    """bf16 only (module docstring): grid (S, B, H/HB), 256 threads, HB heads of one query token."""
    D = _dims()
    B, S, K, N, NC = D["B"], D["S"], D["K"], D["N"], D["NC"]
    HB, threads = _CUDA_HEADS, _CUDA_THREADS
    rows_total = N if kind == "plain" else N + NC
    vec = 8  # values per gather item: 16 B of bf16 in shared memory
    per_row = d // vec
    items = BLOCK * per_row // threads  # gather items per thread and block
    assert d % 64 == 0 and BLOCK * per_row % threads == 0
    bf = "bfloat16"

    groups = _GATHER_GROUPS[kind]
    ig = items // groups  # loads a thread has in flight before it uses any of them

    @T.macro
    def gather(R, KVs, rowS, rb, ru, sb, vl, bb, tx):
        """The rows named in rowS (-1: none) into KVs [BLOCK, d] as bf16 (zeros for none), in
        `groups` rounds: first every load of the round (raw bytes into registers), then the
        decoding and the shared-memory stores, so a round costs one memory latency."""
        for grp in T.unroll(groups):
            for u in T.unroll(ig):
                r = ((grp * ig + u) * threads + tx) // per_row
                c0 = ((grp * ig + u) * threads + tx) % per_row * vec
                if rowS[r] >= 0:
                    if kind == "plain":
                        for j in T.vectorized(vec):
                            rb[u, j] = R["KV"][bb, rowS[r], c0 + j]
                    else:
                        if rowS[r] < N:
                            if kind == "packed_rows":
                                for j in T.vectorized(vec):
                                    rb[u, j] = R["W"][bb, rowS[r], c0 + j]
                            else:
                                for j in T.vectorized(vec):
                                    ru[u, j] = R["W"][bb, rowS[r], c0 + j]
                                sb[u] = R["WS"][bb, rowS[r], c0 // 32]
                        else:
                            for j in T.vectorized(vec // 2):
                                ru[u, j] = R["CC"][bb, rowS[r] - N, c0 // 2 + j]
                            sb[u] = R["CS"][bb, rowS[r] - N, c0 // 16]
            for u in T.unroll(ig):
                r = ((grp * ig + u) * threads + tx) // per_row
                c0 = ((grp * ig + u) * threads + tx) % per_row * vec
                if rowS[r] < 0:
                    for j in T.vectorized(vec):
                        KVs[r, c0 + j] = T.Cast(bf, 0)
                else:
                    if kind == "plain":
                        for j in T.vectorized(vec):
                            KVs[r, c0 + j] = rb[u, j]
                    else:
                        if rowS[r] < N:
                            if kind == "packed_rows":
                                for j in T.vectorized(vec):
                                    KVs[r, c0 + j] = rb[u, j]
                            else:
                                for j in T.unroll(vec):
                                    vl[j] = T.Cast(bf, T.Cast("float32", T.reinterpret(ru[u, j], "float8_e4m3fn"))
                                                   * _e8m0_value(T.Cast("uint32", sb[u])))
                                for j in T.vectorized(vec):
                                    KVs[r, c0 + j] = vl[j]
                        else:
                            for j in T.unroll(vec // 2):
                                vl[2 * j] = T.Cast(bf, _e2m1_value(T.Cast("uint32", ru[u, j]) & T.uint32(0xF))
                                                   * _e4m3_value(T.Cast("uint32", sb[u])))
                                vl[2 * j + 1] = T.Cast(bf, _e2m1_value(T.Cast("uint32", ru[u, j]) >> T.uint32(4))
                                                       * _e4m3_value(T.Cast("uint32", sb[u])))
                            for j in T.vectorized(vec):
                                KVs[r, c0 + j] = vl[j]

    @T.macro
    def next_row(R, nxt, bb, bs, blk, tx):
        """nxt[0] = list entry tx of block blk, -1 past the list (not used before the next block)."""
        nxt[0] = -1
        if blk * BLOCK + tx < K:
            nxt[0] = R["IDX"][bb, bs, blk * BLOCK + tx]

    @T.macro
    def attend(R, bs, bb, bh):
        tx = T.get_thread_binding()
        Qs = T.alloc_shared((HB, d), bf)
        KVs = T.alloc_shared((BLOCK, d), bf)
        Ps = T.alloc_shared((HB, BLOCK), bf)
        rowS = T.alloc_shared((BLOCK,), "int32")  # the block's rows, -1 for none
        Sf = T.alloc_fragment((HB, BLOCK), "float32")
        acc = T.alloc_fragment((HB, d), "float32")
        mrun = T.alloc_fragment((HB,), "float32")
        mnew = T.alloc_fragment((HB,), "float32")
        alpha = T.alloc_fragment((HB,), "float32")
        den = T.alloc_fragment((HB,), "float32")
        psum = T.alloc_fragment((HB,), "float32")
        rb = T.alloc_local((ig, vec), bf)  # loaded bf16 rows
        ru = T.alloc_local((ig, vec), "uint8")  # loaded codes
        sb = T.alloc_local((ig,), "uint8")  # loaded scale bytes
        vl = T.alloc_local((vec,), bf)
        nxt = T.alloc_local((1,), "int32")
        if H % HB == 0:
            T.copy(R["Q"][bb, bs, bh * HB:(bh + 1) * HB, :], Qs)
        else:  # the last CTA's missing heads are zero rows of the GEMM, never stored
            for u in T.serial(T.ceildiv(HB * per_row, threads)):
                if (u * threads + tx) < HB * per_row:
                    for j in T.vectorized(vec):
                        Qs[(u * threads + tx) // per_row, (u * threads + tx) % per_row * vec + j] = T.if_then_else(
                            bh * HB + (u * threads + tx) // per_row < H,
                            R["Q"][bb, bs, bh * HB + (u * threads + tx) // per_row, (u * threads + tx) % per_row * vec + j],
                            T.Cast(bf, 0))
        T.fill(acc, 0)
        T.fill(den, 0)
        T.fill(mrun, _f32_const(_NEG_BIG))
        if tx < BLOCK:
            next_row(R, nxt, bb, bs, 0, tx)
        for blk in T.serial(T.ceildiv(K, BLOCK)):
            if tx < BLOCK:
                rowS[tx] = T.Select(nxt[0] < rows_total, nxt[0], -1)
            T.sync_threads()
            gather(R, KVs, rowS, rb, ru, sb, vl, bb, tx)
            if tx < BLOCK:  # the next block's list entry, in flight during this block's GEMMs
                next_row(R, nxt, bb, bs, blk + 1, tx)
            T.sync_threads()
            T.gemm(Qs, KVs, Sf, transpose_B=True, clear_accum=True)
            for h, i in T.Parallel(HB, BLOCK):
                Sf[h, i] = T.if_then_else(rowS[i] >= 0, Sf[h, i] * _f32_const(scale), -T.infinity("float32"))
            T.reduce_max(Sf, mnew, dim=1, clear=True)
            for h in T.Parallel(HB):
                mnew[h] = T.max(mnew[h], mrun[h])
                alpha[h] = T.exp(mrun[h] - mnew[h])
            for h, i in T.Parallel(HB, BLOCK):
                Sf[h, i] = T.if_then_else(rowS[i] >= 0, T.exp(Sf[h, i] - mnew[h]), T.float32(0))
            T.reduce_sum(Sf, psum, dim=1)
            for h in T.Parallel(HB):
                den[h] = den[h] * alpha[h] + psum[h]
                mrun[h] = mnew[h]
            T.copy(Sf, Ps)
            for h, c in T.Parallel(HB, d):
                acc[h, c] = acc[h, c] * alpha[h]
            T.gemm(Ps, KVs, acc)
            T.sync_threads()
        for h in T.Parallel(HB):
            den[h] = den[h] + T.exp(R["SINK"][T.min(bh * HB + h, H - 1)] - mrun[h])
        for h, c in T.Parallel(HB, d):
            acc[h, c] = acc[h, c] / den[h]
        if H % HB == 0:
            T.copy(acc, R["O"][bb, bs, bh * HB:(bh + 1) * HB, :])
        else:
            for h, c in T.Parallel(HB, d):
                if bh * HB + h < H:
                    R["O"][bb, bs, bh * HB + h, c] = T.Cast(bf, acc[h, c])

    qt, ot = T.Tensor((B, S, H, d), bf), T.Tensor((B, S, H, d), bf)
    st, it = T.Tensor((H,), "float32"), T.Tensor((B, S, K), "int32")
    ct, cst = T.Tensor((B, NC, d // 2), "uint8"), T.Tensor((B, NC, d // 16), "uint8")

    if kind == "plain":
        @T.prim_func
        def main(Q_: qt, KV: T.Tensor((B, N, d), bf), SINK: st, IDX: it, O: ot):
            with T.Kernel(S, B, T.ceildiv(H, HB), threads=threads) as (bs, bb, bh):
                attend({"Q": Q_, "KV": KV, "SINK": SINK, "IDX": IDX, "O": O}, bs, bb, bh)
    elif kind == "packed_rows":
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), bf), CC: ct, CS: cst, SINK: st, IDX: it, O: ot):
            with T.Kernel(S, B, T.ceildiv(H, HB), threads=threads) as (bs, bb, bh):
                attend({"Q": Q_, "W": W, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O},
                       bs, bb, bh)
    else:
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), "uint8"), WS: T.Tensor((B, N, d // 32), "uint8"), CC: ct,
                 CS: cst, SINK: st, IDX: it, O: ot):
            with T.Kernel(S, B, T.ceildiv(H, HB), threads=threads) as (bs, bb, bh):
                attend({"Q": Q_, "W": W, "WS": WS, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O}, bs, bb, bh)
    return main


# ------------------------------------------------------------------------------------- builds

def attention_prim_func(kind: str, dtype: str, H: int, d: int, scale: float, target: str):
    """The prim_func of one op variant: kind in KINDS, dtype "float32"/"bfloat16", target "c"/"cuda"."""
    if kind not in KINDS or dtype not in ("float32", "bfloat16") or H < 1 or d < 1:
        raise ValueError(f"sparse_attn kernels: unknown kind/dtype/shape {kind!r}/{dtype!r}/H={H}/d={d}")
    if target == "c":
        return _cpu_prim_func(kind, dtype, H, d, scale)
    return _cuda_prim_func(kind, H, d, scale)


@functools.lru_cache(maxsize=None)
def build(kind: str, dtype: str, H: int, d: int, scale: float, target: str):
    """Compiled kernel, once per process per key; target "c" (CPU) or "cuda[:sm_XX]"."""
    fn = attention_prim_func(kind, dtype, H, d, scale, "c" if target == "c" else "cuda")
    return compile_for(fn, target)


# ------------------------------------------------------------------------------------- torch.library ops

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}



def _want(op, name, t, dtype, shape, device):
    """Raise unless t has dtype and shape (None entries: any size)."""
    if (t.dtype != dtype or t.dim() != len(shape) or t.device != device
            or any(w is not None and w != g for w, g in zip(shape, t.shape, strict=True))):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{op}: {name} must be {dtype} {want} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_common(op, q, sink, idx):
    if q.dim() != 4 or q.dtype not in _DTYPES:
        raise ValueError(f"{op}: q must be [B,S,H,d] fp32 or bf16, got {q.dtype} {tuple(q.shape)}")
    b, s, h, d = q.shape
    _want(op, "sink", sink, torch.float32, (h,), q.device)
    _want(op, "idx", idx, torch.int32, (b, s, None), q.device)
    if q.is_cuda and (q.dtype != torch.bfloat16 or d % 64 or d > 512):
        raise ValueError(f"{op}: the CUDA build needs bf16 and d a multiple of 64 up to 512, "
                         f"got {q.dtype}, d={d}")
    return b, s, h, d


def _arg(t: torch.Tensor, target: str) -> torch.Tensor:
    """Contiguous (16-byte aligned on CUDA); bf16 as uint16 bits for the C build."""
    t = t.contiguous() if t.numel() else t.new_empty(t.shape)  # the builds check strides, even of empty rows
    if target != "c" and t.data_ptr() % 16:
        t = t.clone()
    return t.view(torch.uint16) if target == "c" and t.dtype == torch.bfloat16 else t


def _run(kind, q, srcs, sink, idx, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if idx.shape[-1] == 0:
        return out.zero_()
    target = kernel_target(q, "sparse_attn")
    b, s, h, d = q.shape
    kernel = build(kind, _DTYPES[q.dtype], h, d, float(scale), target)
    kernel(*(_arg(t, target) for t in (q, *srcs, sink, idx, out)))
    return out


def _sparse_attn(q, kv, sink, idx, scale):
    b, s, h, d = _check_common("sparse_attn", q, sink, idx)
    _want("sparse_attn", "kv", kv, q.dtype, (b, None, d), q.device)
    return _run("plain", q, (kv,), sink, idx, scale)


def _sparse_attn_packed(q, window, window_scales, comp_codes, comp_scales, sink, idx, scale):
    op = "sparse_attn_packed"
    b, s, h, d = _check_common(op, q, sink, idx)
    if d % 32:
        raise ValueError(f"{op}: d must be a multiple of 32 for the packed formats, got {d}")
    n_w = window.shape[1] if window.dim() == 3 else -1
    if window_scales is None:
        _want(op, "window", window, q.dtype, (b, None, d), q.device)
        kind, srcs = "packed_rows", (window,)
    else:
        _want(op, "window", window, torch.uint8, (b, None, d), q.device)
        _want(op, "window_scales", window_scales, torch.uint8, (b, n_w, d // 32), q.device)
        kind, srcs = "packed_fp8", (window, window_scales)
    _want(op, "comp_codes", comp_codes, torch.uint8, (b, None, d // 2), q.device)
    _want(op, "comp_scales", comp_scales, torch.uint8, (b, comp_codes.shape[1], d // 16), q.device)
    return _run(kind, q, (*srcs, comp_codes, comp_scales), sink, idx, scale)


def _fake(q, *args):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_OPS = {
    "sparse_attn": define_op("sparse_attn", "(Tensor q, Tensor kv, Tensor sink, Tensor idx, float scale) -> Tensor",
                             _sparse_attn, _fake),
    "sparse_attn_packed": define_op(
        "sparse_attn_packed",
        ("(Tensor q, Tensor window, Tensor? window_scales, Tensor comp_codes, Tensor comp_scales, "
         "Tensor sink, Tensor idx, float scale) -> Tensor"), _sparse_attn_packed, _fake),
}


def sparse_attn(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """q [B,S,H,d] over the rows of kv [B,N,d] listed in idx [B,S,K] (-1 = none); = sparse_attn_ref."""
    return torch.ops.dsv41c.sparse_attn(q, kv, sink, idx, scale)


def sparse_attn_packed(q, window, window_scales, comp_codes, comp_scales, sink, idx,
                       scale: float) -> torch.Tensor:
    """Attention over cat(window rows, FP4 compressed rows) read from their packed bytes;
    = sparse_attn_packed_ref."""
    return torch.ops.dsv41c.sparse_attn_packed(q, window, window_scales, comp_codes, comp_scales, sink,
                                               idx, scale)
