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
same numbers the reference gathers.  Differences from the reference: the summation order of the
dot products and of the softmax's sum (on CUDA each thread keeps its part of a row's sum until the
list ends) and expf vs torch's exp (fp32 rounding), which can move a bf16 rounding of p or of o by
one ulp; and, on CUDA when the list is split over CTAs (below), the max p is rounded against.

The split's rounding.  The reference rounds p_i = exp(l_i - m_k), m_k the running max over blocks
0..k; a split starts its running max at its first block, so it rounds p'_i = exp(l_i - m'_k),
m'_k <= m_k, and the combine rescales by exp(m'_k - M) (M, the final max, is the same).  In exact
arithmetic both give w_i (1 + d_i) v_i, w_i = exp(l_i - M), with a bf16 relative rounding error
|d_i| <= 2^-8: the split changes which rounding error a term gets, not its size, so the kernel
keeps the reference's distance to the exact softmax (DESIGN.md's bf16-vs-fp32 comparison),
|o - o_exact| <= 2^-8 sum_i w_i |v_i| / den <= 2^-8 max|v|; the sums (fp32 p) are unchanged.
Against the reference the worst case doubles, but the errors are independent and mostly cancel:
a torch emulation of the split at the released decode shapes (4 and 10 splits, 6 seeds x 1M
outputs) moved o by at most one bf16 ulp, a third of the tests' tolerance 2^-8 (|o| + max|v|)
(one ulp, <= 2^-7 |o|, is within it since |o| <= max|v|).  A block whose running max is reached
inside its split (m'_k = m_k), every block of the first split, and every whole-list call round p
exactly as the reference does.

CPU (C target): one program per query token (grid S x B); per block of 64 entries the listed rows
are gathered (dequantised) into an fp32 local tile [64, d], then every head computes its logits,
updates its running max/sum and accumulates p . rows into acc [H, d] (fp32, local).  bf16 travels
as uint16 bits.  One build per (kind, dtype, H, d, scale, target); B, S, K and the row counts are
dynamic.

CUDA (sm_90a, wgmma through T.gemm; bf16 only: the tensor cores take bf16 operands and an fp32 call
raises).  A CTA of 256 threads (two warpgroups) owns HB = 64 heads (one wgmma M; fewer heads: zero
rows, not stored) of one query token and walks a run of blocks of its list; KV is shared by all
heads (MQA), so one gathered tile serves every head.  Per block:
  - the block's 64 row numbers sit in shared memory (two slots by parity; the next block's list
    entries are loaded one block ahead);
  - cp.async copies the listed rows as stored (1 KB of bf16, 512 B of FP8 codes + 16 scale bytes,
    or 256 B of E2M1 codes + 32 scale bytes) into a shared stage, 16-byte chunks;
    block i+1's copies are issued before block i's GEMMs, so the gather of the next block overlaps
    the current block's compute (and the first block's is in flight with q's tile, which
    cp.async copies too: 1.02-1.03x on an H100 against loads and stores);
  - the stage is decoded into KVs [64, d] bf16 (each thread: 16 items of 8 values, one 16-byte
    store each; the packed formats by bit moves and paired conversions, `_ROW8_PRELUDE`; rows -1
    or past the row count: zeros); a block of one row kind (all compressed, or all FP8 window
    rows, as in a long decode) is copied and decoded without a branch per row (`_DECODE_GROUP`);
  - S = q K^T [64, 64] (fp32 accumulation), the online softmax (its row reductions by hand,
    `_SOFTMAX_PRELUDE`: one exchange between the warpgroups a block), acc += bf16(p) V [64, d].
The fp32 accumulator [64, 512] is 128 of a thread's 234 registers; shared memory q 64 KB + KVs
64 KB + the stage (33 KB for the FP8 ring, 66 KB for bf16 rows) + p 8 KB: 173-205 KB, one CTA per SM.
Grid: when the query-head groups (B*S*ceil(H/64)) fill the SMs (prefill, large batches), one CTA
per group walks the whole list and writes o (the reference's rounding of p exactly).  Otherwise
(decode) the list is split (flash decoding): NS CTAs per group, `num_splits` picking the fewest
blocks per CTA that keep all CTAs in one wave (H200, H=64, K=640: batch 1 -> 10 CTAs of 1 block,
batch 32 -> 4 CTAs of 3, 3, 3, 1 blocks), each writing its unnormalised acc [H, d], running max and
sum in fp32; a second kernel merges them: M = max_j m_j, o = sum_j acc_j e^(m_j - M) /
(sum_j l_j e^(m_j - M) + e^(sink - M)).  Where NS is even and each CTA walks at least two blocks
(`pair_merged`: batch 32), CTAs 2p and 2p + 1 run as a cluster of two and first merge their two
partials into one the same way, through distributed shared memory (half the partials written and
read back; the fp32 sums then round in two levels instead of one).  The merging kernel is launched
programmatically: the split kernel triggers at its start, so the merge's launch hides under its
tail, and the merge waits (griddepcontrol) before it reads any partial.  The split depends on the
batch, so a sequence's output may differ by the rounding above between batch sizes.  The packed
builds need d a multiple of 128 (a window row's scales must fill a 4-byte cp.async).
"""

import functools
import math

import tilelang.cpu.language as TC
import tilelang.cuda.language as TCU
import tilelang.language as T
import torch

from dsv41c import quant as Q
from dsv41c.attention import sparse_attn as sparse_attn_ref
from dsv41c.tilelang_kernels.quant import (CUDA_E2M1_WORDS, CUDA_PACK_BF16X2, _bits, _e2m1_value, _e4m3_value,
                                            _e8m0_value, _store, compile_for, cuda_trace_prelude,
                                            define_op, kernel_target, rows_buffer, trace_macros)

__all__ = ["BLOCK", "KINDS", "attention_prim_func", "build", "combine_prim_func", "num_splits",
           "packed_head_dim_problem", "pair_merged", "sparse_attn", "sparse_attn_packed",
           "sparse_attn_packed_ref", "sparse_attn_ref"]

BLOCK = 64  # list entries per online-softmax step (§6.8)
KINDS = ("plain", "packed_rows", "packed_fp8")  # kv rows; packed with a plain window; packed with an FP8 ring
_CUDA_THREADS = 256  # 512 builds and runs (16 warps per SM, spilling at 128 registers) but was no faster
_CUDA_HEADS = 64  # heads per CTA (one wgmma M)
_NEG_BIG = -1e30
# CUDA: the fewest blocks a CTA of a split list walks (1: as many CTAs as fill one wave; more trades
# CTAs for fewer partials to write and merge)
_MIN_SPLIT_BLOCKS = 1
# CUDA: a split into an even number NS of CTAs per query, each walking at least `_PAIR_MIN_BLOCKS`
# blocks (ceil(blocks / NS)), runs them as clusters of two, whose pair merges its two partials on
# chip (distributed shared memory, `pair_merge`) and writes one: half the fp32 partials written and
# read back by the combine.  On an H100, 64K: batch 32 (4 CTAs of 3, 3, 3, 1 blocks) 24.0-24.2 us
# against 24.7-25.3; batch 1 (10 CTAs of 1 block) 13.4-13.6 against 11.3, where the merge's own
# cost (the acc through shared memory, two cluster barriers) outweighs what it saves.
_PAIR_MIN_BLOCKS = 2
_PAIR_PAD = 8  # fp32 padding of a row of the shared accumulator copy: conflict-free 8-byte stores
# items (4 columns of one head from both CTAs, with their maxima and sums) whose distributed shared
# memory loads the pair merge issues together: 4 makes four dependent rounds of 16 items a thread.
# The merge of a batch-32 CTA takes about 6,700 cycles (benchmarks/attention.py --trace); 8 and 16
# (acc is dead by then) build without spills; 16 was timed on an H100 (BENCHMARKS.md): 0.95x at
# batch 32.
_PAIR_GROUP = 4
# CUDA combine: partials loaded together, one round trip to L2 a group (`_combine_prim_func`).  At
# batch 1 (10 partials) 4 makes three dependent trips; 16 was timed on an H100 (BENCHMARKS.md): no
# faster at batch 1, 1.2x slower at batch 32.
_COMBINE_UNROLL = 4
# CUDA, a diagnostic: 0, or (set by `benchmarks/attention.py --trace` before its first build) the
# device address of an int64 buffer [CTAs, TRACE_SLOTS] into which thread 0 of each CTA writes its SM
# clock (clock64) at the phase boundaries of `attend` (`_TRACE_MARKS`), its SM number, and the global
# timer at its start and end.  0 builds no marks: the lowered source is the kernel's.
_TRACE = 0
TRACE_SLOTS = 32
_TRACE_BLOCKS = 4  # blocks of a run whose phases are marked
# slot -> what precedes the mark, in the order of the marks in time; block i's five are at 3 + 5 i ..
_TRACE_MARKS = {0: "start", 1: "the first row numbers set", 2: "the first copies issued (rows, q)",
                **{3 + 5 * i + k: f"block {i}: {what}" for i in range(_TRACE_BLOCKS)
                   for k, what in enumerate(("copies landed", "decoded", "GEMM1", "softmax, P, rescale",
                                             "GEMM2"))},
                28: "the loop's end (sums totalled)", 23: "pair merge: acc, maxima and sums in shared memory",
                24: "pair merge: the cluster barrier", 25: "pair merge: the merged partial stored",
                29: "the partial or o written"}
_TRACE_SM, _TRACE_T0, _TRACE_T1 = 27, 30, 31  # slots: SM number; global timer (ns) at marks 0 and 29
_TRACE_CHAINS = [list(_TRACE_MARKS)]  # (one thread marks them all)

# The cluster barrier and the loads from the other CTA's shared memory (mapa + ld.shared::cluster)
# of the pair merge (`_PAIR_MIN_BLOCKS`).
_PAIR_PRELUDE = r"""
// Trap unless the kernel runs in clusters of 2 CTAs (a launch without them would read wrong CTAs).
__device__ __forceinline__ void dsv41c_pair_check() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  if (n != 2u) __trap();
}

__device__ __forceinline__ void dsv41c_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The shared::cluster address of p (this CTA's shared memory) in the cluster's CTA `rank`.
__device__ __forceinline__ unsigned dsv41c_peer(const void* p, unsigned rank) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p)), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}

// The float at p in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float dsv41c_ld_peer(const void* p, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(dsv41c_peer(p, rank)) : "memory");
  return v;
}

// The 4 floats at p (16-byte aligned) in the shared memory of the cluster's CTA `rank`, into v.
__device__ __forceinline__ void dsv41c_ld_peer4(float* v, const void* p, unsigned rank) {
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(dsv41c_peer(p, rank)) : "memory");
}
"""

# CUDA: a block whose listed rows are all compressed, or all FP8 window rows, is decoded by a loop
# without the per-item branch on the row kind, each group of `_DECODE_GROUP` items' loads before
# their arithmetic (ptxas keeps an item's loads after the previous item's store otherwise: it cannot
# tell the stage from KVs); the kinds are voted per warp where the row numbers are set
# (`_KINDS_PRELUDE`).  1.11x at batch 32 on an H100 (groups of 4, 8 and 16 items: the same).
_DECODE_GROUP = 8
# Such a block's rows are also copied into the stage without the branch on each row's kind, the
# kind's chunks spread over all threads (a compressed row's 256 B of codes took 8 rounds of 16-byte
# chunks with half the threads idle, as a window row's 512 B does): 1.07x at batch 32 on an H100.
_KINDS_PRELUDE = r"""
// bit 0: every lane's row is compressed (>= n_window); bit 1: every lane's row is a window row
__device__ __forceinline__ int dsv41c_warp_kinds(int row, int n_window) {
  return (__all_sync(0xffffffffu, row >= n_window) ? 1 : 0) |
         (__all_sync(0xffffffffu, row >= 0 && row < n_window) ? 2 : 0);
}
"""

# CUDA: 8 values of a packed row (one decode item) into 8 bf16, bit-identical to the references.
# - FP8 window rows: each pair of E4M3 codes through one cvt to f16x2 (exact), then the
#   reference's operations, fp32 product by 2^(s-127) (UE8M0 byte s; 0: 2^-127, 255: NaN) rounded
#   to bf16; the scale is made once per item.
# - FP4 compressed rows: the E2M1 x 2^-126 words of `CUDA_E2M1_WORDS` (values j, j + 4), put back
#   in value order by byte permutes, then two bf16x2 multiplies, by 2^126 and by the E4M3 scale
#   (exact in bf16; made from the byte through f16).  E2M1 times an E4M3 scale needs at most 6
#   significant bits and stays in bf16's normal range, so both products are exact, like the
#   reference's fp32 ones; a NaN scale gives NaN.
# About 33-36 SASS instructions an item, against 45 (FP4, a table of the 16 E2M1 values) and 90
# (FP8, per-value conversions, the scale's special cases made per value) before: 1.19x at batch 32
# and 1.25x at batch 1 in a CUDA graph on an H100 (BENCHMARKS.md).
_ROW8_PRELUDE = CUDA_PACK_BF16X2 + CUDA_E2M1_WORDS + r"""
__device__ __forceinline__ unsigned dsv41c_e4m3x2_f16x2(unsigned short c) {
  unsigned h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(c));
  return h;
}

// the low and the high f16 of h as fp32 (exact); PTX: the prelude comes before the CUDA headers
__device__ __forceinline__ float dsv41c_f16_lo(unsigned h) {
  float f;
  asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %1;\n cvt.f32.f16 %0, l;\n}" : "=f"(f) : "r"(h));
  return f;
}

__device__ __forceinline__ float dsv41c_f16_hi(unsigned h) {
  float f;
  asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %1;\n cvt.f32.f16 %0, u;\n}" : "=f"(f) : "r"(h));
  return f;
}

// 8 E4M3 codes (the 8 bytes at codes) with the UE8M0 scale byte s -> 8 bf16 at out
__device__ __forceinline__ void dsv41c_fp8_row8(const void* codes, unsigned s, void* out) {
  const uint2 c = *reinterpret_cast<const uint2*>(codes);
  const float scale = __uint_as_float(s == 0u ? 0x00400000u : (s == 255u ? 0x7FC00000u : s << 23));
  const unsigned w[2] = {c.x, c.y};
  unsigned o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned h = dsv41c_e4m3x2_f16x2(static_cast<unsigned short>(w[k / 2] >> (16 * (k % 2))));
    o[k] = dsv41c_pack_bf16x2(dsv41c_f16_lo(h) * scale, dsv41c_f16_hi(h) * scale);
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(o[0], o[1], o[2], o[3]);
}

// 8 E2M1 codes (the 4 bytes at codes; value 2k in the low nibble of byte k) with the E4M3 scale
// byte s -> 8 bf16 at out: E2M1 x 2^-126 words, times 2^126, times the scale (scale x 2^126 would
// overflow bf16 from scale 4 on; one multiply where every scale of a group is below 4 was timed on an
// H100: 1-4% slower).
__device__ __forceinline__ void dsv41c_fp4_row8(const void* codes, unsigned s, void* out) {
  unsigned x[4];
  dsv41c_e2m1_words(*reinterpret_cast<const unsigned*>(codes), x);
  const float f = dsv41c_f16_lo(dsv41c_e4m3x2_f16x2(static_cast<unsigned short>(s & 0xFFu)));
  const unsigned sc = dsv41c_pack_bf16x2(f, f);
  const unsigned o[4] = {__byte_perm(x[0], x[1], 0x5410), __byte_perm(x[2], x[3], 0x5410),
                         __byte_perm(x[0], x[1], 0x7632), __byte_perm(x[2], x[3], 0x7632)};
  unsigned v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = dsv41c_mul_bf16x2(dsv41c_mul_bf16x2(o[k], 0x7E807E80u), sc);
  *reinterpret_cast<uint4*>(out) = make_uint4(v[0], v[1], v[2], v[3]);
}
"""


# CUDA: the online softmax's row reductions by hand (`_SOFTMAX_PRELUDE`).  S [64 heads, 64 entries]
# is split over the two warpgroups by entries, so each of TileLang's row reductions (T.reduce_max,
# T.reduce_sum) crossed them through shared memory: per block, for each of a thread's two rows, a
# __syncthreads and two named barriers, both for the max and for the sum, 12 CTA-wide barriers in
# all.  By hand: one exchange of the warpgroups' row maxima a block (one named barrier), and the sums
# kept per thread (the same running max rescales every thread's partial, so they add up to the row's
# sum) until the loop ends.  1.09x at batch 32 on an H100 (BENCHMARKS.md).
# The wgmma accumulator layout of S (T.gemm's, read off its lowered code): warpgroup g holds entries
# 32g..32g+31; thread t (warp w of its warpgroup, lane l) rows r0 = 16w + l/4 and r0 + 8 (h = 0, 1)
# at s[4j + 2h + e], entry 32g + 8j + 2(l % 4) + e (j = 0..3, e = 0, 1); the four lanes of a quad
# share rows.  xch: 2 x 64 fp32 of shared memory.
_SOFTMAX_PRELUDE = r"""
// One block's online softmax for the thread's two rows h (the module docstring's numerics):
// s = valid ? s * scale : -inf (valid: the entry's row number >= 0); the block's row max over both
// warpgroups (quad shuffles, then one exchange through xch); m = max(that, mrun), alpha =
// exp(mrun - m), s = exp(s - m) (0 where invalid); den = den * alpha + the thread's part of the row
// sum; mrun = m.
__device__ __forceinline__ void dsv41c_softmax_block(float* s, const int* rows, float* mrun, float* den,
                                                     float* alpha, float* xch, float scale) {
  const int t = threadIdx.x, g = t >> 7, l = t & 31, r0 = 16 * ((t >> 5) & 3) + (l >> 2);
  const float ninf = __int_as_float(0xff800000);
  bool ok[8];
  float mx[2] = {ninf, ninf};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int2 v = *reinterpret_cast<const int2*>(rows + 32 * g + 8 * j + 2 * (l & 3));
    ok[2 * j] = v.x >= 0;
    ok[2 * j + 1] = v.y >= 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = ok[2 * j + e] ? x * scale : ninf;
        mx[h] = fmaxf(mx[h], x);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
  if ((l & 3) == 0) {
    xch[64 * g + r0] = mx[0];
    xch[64 * g + r0 + 8] = mx[1];
  }
  asm volatile("bar.sync 8, 256;" ::: "memory");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m = fmaxf(fmaxf(mx[h], xch[64 * (g ^ 1) + r0 + 8 * h]), mrun[h]);
    alpha[h] = expf(mrun[h] - m);
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = expf(x - m);  // an unlisted entry's -inf gives 0 (m is finite: at least -1e30)
        part += x;
      }
    }
    den[h] = den[h] * alpha[h] + part;
    mrun[h] = m;
  }
}

// acc[4j + 2h + e] (the n fp32 of a wgmma accumulator, rows h as above) times f[h], or divided by it
template <bool divide>
__device__ __forceinline__ void dsv41c_rows_scale(float* acc, const float* f, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) acc[i] = divide ? acc[i] / f[(i >> 1) & 1] : acc[i] * f[(i >> 1) & 1];
}

// v[h] = the sum of v[h] over the row's eight threads (a quad of each warpgroup); the same value in
// each (the additions commute)
__device__ __forceinline__ void dsv41c_row_total(float* v, float* xch) {
  const int t = threadIdx.x, g = t >> 7, l = t & 31, r0 = 16 * ((t >> 5) & 3) + (l >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    v[h] += __shfl_xor_sync(0xffffffffu, v[h], 1);
    v[h] += __shfl_xor_sync(0xffffffffu, v[h], 2);
  }
  asm volatile("bar.sync 8, 256;" ::: "memory");
  if ((l & 3) == 0) {
    xch[64 * g + r0] = v[0];
    xch[64 * g + r0 + 8] = v[1];
  }
  asm volatile("bar.sync 8, 256;" ::: "memory");
  v[0] += xch[64 * (g ^ 1) + r0];
  v[1] += xch[64 * (g ^ 1) + r0 + 8];
}
"""


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


def _rows_total(kind, N, R):
    """Entries below this are rows (window rows, then compressed ones); NV, a scalar argument, is
    the valid rows of the last buffer, which may hold more (a cache's rows as allocated)."""
    return R["NV"] if kind == "plain" else N + R["NV"]


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
                ok[i] = T.Select(t >= 0, T.Select(t < _rows_total(kind, N, R), 1, 0), 0)
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
        def main(Q_: qt, KV: T.Tensor((B, N, d), vt), SINK: st, IDX: it, O: ot, NV: T.int32):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "KV": KV, "SINK": SINK, "IDX": IDX, "O": O, "NV": NV}, b, s)
    elif kind == "packed_rows":
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), vt), CC: ct, CS: cst, SINK: st, IDX: it, O: ot, NV: T.int32):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "W": W, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O, "NV": NV}, b, s)
    else:
        @T.prim_func
        def main(Q_: qt, W: T.Tensor((B, N, d), "uint8"), WS: T.Tensor((B, N, d // 32), "uint8"), CC: ct,
                 CS: cst, SINK: st, IDX: it, O: ot, NV: T.int32):
            with TC.Kernel(S, B) as (s, b):
                attend({"Q": Q_, "W": W, "WS": WS, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O,
                        "NV": NV}, b, s)
    return main


# ------------------------------------------------------------------------------------- CUDA

def _cuda_prim_func(kind, H, d, scale, split, pair=False):
    """bf16 only (module docstring): CTAs of 256 threads, each HB heads of one query token.
    split False: grid (S, B, HG), a CTA walks the whole list and writes o.  split True: grid
    (NS, S, B*HG), CTA j walks the j-th run of ceil(blocks / NS) blocks and writes its partial
    (acc, running max, sum) for `_combine_prim_func`.  pair (`pair_merged`): grid (2 NP, S, B*HG) in
    clusters of two, NP partials, each the on-chip merge of CTAs 2p and 2p + 1's."""
    D = _dims()
    B, S, K, N, NC, NP = D["B"], D["S"], D["K"], D["N"], D["NC"], T.dynamic("NS")
    NS = 2 * NP if pair else NP  # the CTAs (runs of the list) of a query; NP: its partials
    assert split or not pair
    HB, threads = _CUDA_HEADS, _CUDA_THREADS
    HG = -(-H // HB)
    assert threads == 2 * 128 and HB == 64, "_SOFTMAX_PRELUDE's layout: two warpgroups, one wgmma M"
    uni = kind != "plain"  # blocks of one row kind copied and decoded without branches (`_KINDS_PRELUDE`)
    nacc = HB * d // threads  # fp32 of acc a thread holds
    vec = 8  # values per decoded item: 16 B of bf16 in shared memory
    per_row = d // vec
    items = BLOCK * per_row // threads  # decoded items per thread and block
    UG = math.gcd(_DECODE_GROUP, items)  # items a group (decode_uniform)
    assert d % 64 == 0 and (kind == "plain" or d % 128 == 0)
    bf, f32 = "bfloat16", "float32"
    # The stage holds a block's listed rows as stored: a row of the window's format (bf16, or FP8
    # codes) or packed E2M1 codes at the start of the row; stage_s their scale bytes.  Copied in
    # chunks of 16 B (codes) and sc B (scales: the largest cp.async size dividing a window row's d/32).
    stage_t = "uint8" if kind == "packed_fp8" else bf
    ce = 16 if kind == "packed_fp8" else 8  # stage elements per 16 B
    cpr = d // ce  # 16-byte chunks in a window row
    sc = next(n for n in (16, 8, 4) if (d // 32) % n == 0) if kind != "plain" else 0
    spr = d // 16 // sc if sc else 0  # scale chunks in a compressed row (a window row: half)

    def cp_async(n, dst, src):
        # an extern call: TileLang's own T.ptx_cp_async makes its sync pass put a __syncthreads
        # around every copy; the waits and barriers here are explicit (attend)
        return T.call_extern("handle", f"tl::cp_async_gs<{n}>", T.address_of(dst), T.address_of(src))

    mark, mark_first = trace_macros(bool(_TRACE))  # (thread 0 marks every phase)

    def mark_block(i, k):
        """Block i's mark k of 5 (the first `_TRACE_BLOCKS` blocks)."""
        return mark_first(i, 3 + 5 * i + k, _TRACE_BLOCKS)

    @T.macro
    def issue(R, stage, stage_s, rowS, buf, bb, tx):
        """cp.async of the rows named in rowS[buf] into the stage, one commit group; -1: none copied."""
        for u in T.unroll(BLOCK * cpr // threads):
            r = (u * threads + tx) // cpr
            p = (u * threads + tx) % cpr
            if rowS[buf, r] >= 0:
                if kind == "plain":
                    cp_async(16, stage[r, p * ce], R["KV"][bb, rowS[buf, r], p * ce])
                else:
                    if rowS[buf, r] < N:
                        cp_async(16, stage[r, p * ce], R["W"][bb, rowS[buf, r], p * ce])
                    elif p < d // 32:  # a compressed row: d/2 bytes
                        cp_async(16, stage[r, p * ce], R["CC"][bb, rowS[buf, r] - N, p * 16])
        if kind != "plain":
            for u in T.unroll(-(-BLOCK * spr // threads)):
                r = (u * threads + tx) // spr
                p = (u * threads + tx) % spr
                if u * threads + tx < BLOCK * spr:  # (nested: r is a row only then)
                    if rowS[buf, r] >= N:
                        cp_async(sc, stage_s[r, p * sc], R["CS"][bb, rowS[buf, r] - N, p * sc])
                    elif kind == "packed_fp8" and rowS[buf, r] >= 0:  # a window row: d/32 scale bytes
                        if p < spr // 2:
                            cp_async(sc, stage_s[r, p * sc], R["WS"][bb, rowS[buf, r], p * sc])
        T.ptx_commit_group()

    @T.macro
    def issue_uniform(R, stage, stage_s, rowS, buf, row_kind, bb, tx):
        """issue for a block of one row kind ("comp", or "window" in the FP8 format): the kind's
        chunks only, spread over every thread, without a branch on the row (`_DECODE_GROUP`)."""
        cc = d // 32 if row_kind == "comp" else cpr  # 16-byte chunks of a row's codes
        for u in T.unroll(BLOCK * cc // threads):
            r = (u * threads + tx) // cc
            p = (u * threads + tx) % cc
            if row_kind == "comp":
                cp_async(16, stage[r, p * ce], R["CC"][bb, rowS[buf, r] - N, p * 16])
            else:
                cp_async(16, stage[r, p * ce], R["W"][bb, rowS[buf, r], p * ce])
        ns = spr if row_kind == "comp" else spr // 2  # scale chunks of a row
        for u in T.unroll(-(-BLOCK * ns // threads)):
            rs = (u * threads + tx) // ns
            ps = (u * threads + tx) % ns
            if u * threads + tx < BLOCK * ns:
                if row_kind == "comp":
                    cp_async(sc, stage_s[rs, ps * sc], R["CS"][bb, rowS[buf, rs] - N, ps * sc])
                else:
                    cp_async(sc, stage_s[rs, ps * sc], R["WS"][bb, rowS[buf, rs], ps * sc])
        T.ptx_commit_group()

    def one_kind(kindS, buf, bit):
        """Whether both warps voted kind `bit` (set_row) for every row of block buf."""
        return (kindS[buf, 0] & kindS[buf, 1] & bit) != 0

    @T.macro
    def issue_block(R, stage, stage_s, rowS, kindS, buf, bb, tx):
        """issue, or issue_uniform for a block of one row kind (kindS[buf])."""
        if uni:
            if one_kind(kindS, buf, 1):
                issue_uniform(R, stage, stage_s, rowS, buf, "comp", bb, tx)
            elif kind == "packed_fp8" and one_kind(kindS, buf, 2):
                issue_uniform(R, stage, stage_s, rowS, buf, "window", bb, tx)
            else:
                issue(R, stage, stage_s, rowS, buf, bb, tx)
        else:
            issue(R, stage, stage_s, rowS, buf, bb, tx)

    @T.macro
    def item(row_kind, stage, stage_s, r, c0, KVs, cb, vl):
        """Values c0..c0+7 of staged row r into KVs as bf16 (one 16-byte store): row_kind "none"
        (zeros), "window" (a row in the window's format) or "comp" (packed E2M1 codes: bytes
        c0/2..c0/2+3 of the stage row)."""
        if row_kind == "none":
            for j in T.vectorized(vec):
                KVs[r, c0 + j] = T.Cast(bf, 0)
        elif row_kind == "window" and kind != "packed_fp8":
            for j in T.vectorized(vec):
                KVs[r, c0 + j] = stage[r, c0 + j]
        elif row_kind == "window":
            for j in T.vectorized(vec):
                cb[j] = stage[r, c0 + j]
            T.call_extern("handle", "dsv41c_fp8_row8", T.address_of(cb[0]),
                          T.Cast("uint32", stage_s[r, c0 // 32]), T.address_of(vl[0]))
            for j in T.vectorized(vec):
                KVs[r, c0 + j] = vl[j]
        else:
            if kind == "packed_fp8":
                for j in T.vectorized(vec // 2):
                    cb[j] = stage[r, c0 // 2 + j]
            else:
                for j in T.unroll(vec // 2):
                    cb[j] = T.Cast("uint8", T.reinterpret(stage[r, c0 // 4 + j // 2], "uint16")
                                   >> T.uint16(8 * (j % 2)))
            T.call_extern("handle", "dsv41c_fp4_row8", T.address_of(cb[0]),
                          T.Cast("uint32", stage_s[r, c0 // 16]), T.address_of(vl[0]))
            for j in T.vectorized(vec):
                KVs[r, c0 + j] = vl[j]

    @T.macro
    def decode_items(row_kind, rowS, buf, stage, stage_s, KVs, cb, vl, tx):
        """Every item of the thread, by the row kind of rowS[buf] (row_kind None: each row's own)."""
        for u in T.unroll(items):
            r = (u * threads + tx) // per_row
            c0 = (u * threads + tx) % per_row * vec
            if row_kind is not None:
                item(row_kind, stage, stage_s, r, c0, KVs, cb, vl)
            elif rowS[buf, r] < 0:
                item("none", stage, stage_s, r, c0, KVs, cb, vl)
            elif kind == "plain" or rowS[buf, r] < N:
                item("window", stage, stage_s, r, c0, KVs, cb, vl)
            else:
                item("comp", stage, stage_s, r, c0, KVs, cb, vl)

    @T.macro
    def decode_group(fn, g, KVs, cbs, scs, vl, tx):
        """Group g's UG loaded items decoded by the prelude function fn and stored."""
        for k in T.unroll(UG):
            r = ((g * UG + k) * threads + tx) // per_row
            c0 = ((g * UG + k) * threads + tx) % per_row * vec
            T.call_extern("handle", fn, T.address_of(cbs[k, 0]), scs[k], T.address_of(vl[0]))
            for j in T.vectorized(vec):
                KVs[r, c0 + j] = vl[j]

    @T.macro
    def decode_uniform(row_kind, stage, stage_s, KVs, cbs, scs, vl, tx):
        """decode_items for a block of one row kind ("window" in the FP8 format, or "comp"): each
        group of UG items' codes and scale bytes loaded before any is decoded (`_DECODE_GROUP`)."""
        nb8 = vec if row_kind == "window" else vec // 2  # code bytes an item
        for g in T.unroll(items // UG):
            for k in T.unroll(UG):
                r = ((g * UG + k) * threads + tx) // per_row
                c0 = ((g * UG + k) * threads + tx) % per_row * vec
                if row_kind == "window":
                    for j in T.vectorized(nb8):
                        cbs[k, j] = stage[r, c0 + j]
                    scs[k] = T.Cast("uint32", stage_s[r, c0 // 32])
                else:
                    if kind == "packed_fp8":
                        for j in T.vectorized(nb8):
                            cbs[k, j] = stage[r, c0 // 2 + j]
                    else:  # (the stage of bf16 window rows: the codes are its elements' bytes)
                        for j in T.unroll(nb8):
                            cbs[k, j] = T.Cast("uint8", T.reinterpret(stage[r, c0 // 4 + j // 2], "uint16")
                                               >> T.uint16(8 * (j % 2)))
                    scs[k] = T.Cast("uint32", stage_s[r, c0 // 16])
            fn = "dsv41c_fp8_row8" if row_kind == "window" else "dsv41c_fp4_row8"
            decode_group(fn, g, KVs, cbs, scs, vl, tx)

    @T.macro
    def decode(stage, stage_s, rowS, kindS, buf, KVs, cb, cbs, scs, vl, tx):
        """The staged rows named in rowS[buf] into KVs [BLOCK, d] as bf16 (zeros for -1): each item
        (8 values) is read from the stage and scales, decoded (`_ROW8_PRELUDE`) and stored as one
        16-byte vector.  Packed rows: a block of one row kind (kindS[buf]) takes that kind's
        branch-free loop (`_DECODE_GROUP`)."""
        if uni:
            if one_kind(kindS, buf, 1):
                decode_uniform("comp", stage, stage_s, KVs, cbs, scs, vl, tx)
            elif kind == "packed_fp8" and one_kind(kindS, buf, 2):
                decode_uniform("window", stage, stage_s, KVs, cbs, scs, vl, tx)
            else:
                decode_items(None, rowS, buf, stage, stage_s, KVs, cb, vl, tx)
        else:
            decode_items(None, rowS, buf, stage, stage_s, KVs, cb, vl, tx)

    @T.macro
    def set_row(R, rowS, kindS, buf, v, tx):
        """rowS[buf, tx] = v (tx < BLOCK; -1 past the rows); packed rows: the warp's row kinds into
        kindS[buf, warp], bit 0 every row compressed, bit 1 every row a window row."""
        rowS[buf, tx] = T.Select(v < _rows_total(kind, N, R), v, -1)
        if uni:
            fl = T.call_extern("int32", "dsv41c_warp_kinds", rowS[buf, tx], N)
            if tx % 32 == 0:
                kindS[buf, tx // 32] = fl

    @T.macro
    def next_row(R, nxt, bb, bs, blk, tx):
        """nxt[0] = list entry tx of block blk, -1 past the list."""
        nxt[0] = -1
        if blk * BLOCK + tx < K:
            nxt[0] = R["IDX"][bb, bs, blk * BLOCK + tx]

    @T.macro
    def pair_merge(R, acc, mrun, den, head, bj, bs, bb, bh, tx):
        """The pair's two partials merged and written as partial bj // 2: each CTA leaves its acc
        (rows padded), running max and sum in its shared memory; after a cluster barrier CTA rank
        r = bj % 2 merges heads 32 r .. 32 r + 31 of both, reading the other's through distributed
        shared memory, m = max(m_0, m_1), acc = acc_0 e^(m_0 - m) + acc_1 e^(m_1 - m), the same for
        the sum; a second barrier keeps each CTA's shared memory alive until the other is done."""
        rows, G = HB // 2, _PAIR_GROUP  # heads a CTA merges; items whose loads go out together
        Xs = T.alloc_shared((HB, d + _PAIR_PAD), f32)  # (the planner places it over the dead tiles)
        Ms = T.alloc_shared((HB,), f32)
        Ls = T.alloc_shared((HB,), f32)
        ml = T.alloc_local((G, 4), f32)  # an item's m_0, m_1, l_0, l_1
        xs = T.alloc_local((G, 2, 4), f32)  # its 4 columns of acc_0 and acc_1
        mx = T.alloc_var(f32)
        T.call_extern("handle", "dsv41c_pair_check")
        T.sync_threads()  # every warpgroup's last GEMM is done with the tiles Xs may cover
        if tx % 4 == 0 and tx < 128:
            for k in [0, 1]:  # (a list: unrolled at trace time)
                Ms[head[k]] = mrun[k]
                Ls[head[k]] = den[k]
        for h, c in T.Parallel(HB, d):
            Xs[h, c] = acc[h, c]
        mark(23)
        T.call_extern("handle", "dsv41c_cluster_sync")
        mark(24)
        for g in T.serial(rows * d // 4 // threads // G):
            for k in T.unroll(G):  # the group's loads first: in flight together
                h = bj % 2 * rows + ((g * G + k) * threads + tx) // (d // 4)
                c = ((g * G + k) * threads + tx) % (d // 4) * 4
                for j in T.unroll(2):  # ranks 0, 1
                    ml[k, j] = T.call_extern(f32, "dsv41c_ld_peer", T.address_of(Ms[h]), j)
                    ml[k, 2 + j] = T.call_extern(f32, "dsv41c_ld_peer", T.address_of(Ls[h]), j)
                    T.call_extern("handle", "dsv41c_ld_peer4", T.address_of(xs[k, j, 0]), T.address_of(Xs[h, c]), j)
            for k in T.unroll(G):
                h = bj % 2 * rows + ((g * G + k) * threads + tx) // (d // 4)
                c = ((g * G + k) * threads + tx) % (d // 4) * 4
                mx = T.max(ml[k, 0], ml[k, 1])
                ml[k, 0] = T.exp(ml[k, 0] - mx)
                ml[k, 1] = T.exp(ml[k, 1] - mx)
                for v in T.unroll(4):
                    xs[k, 0, v] = xs[k, 0, v] * ml[k, 0] + xs[k, 1, v] * ml[k, 1]
                if bh * HB + h < H:
                    for v in T.vectorized(4):
                        R["OP"][bb, bs, bj // 2, bh * HB + h, c + v] = xs[k, 0, v]
                    if c == 0:
                        R["MP"][bb, bs, bj // 2, bh * HB + h] = mx
                        R["LP"][bb, bs, bj // 2, bh * HB + h] = ml[k, 2] * ml[k, 0] + ml[k, 3] * ml[k, 1]
        mark(25)
        T.call_extern("handle", "dsv41c_cluster_sync")

    @T.macro
    def attend(R, bj, bs, bb, bh):
        """Heads bh*HB.. of query (bb, bs) over blocks blk0 .. blk0+nb-1 of its list: split j of NS
        (split), or the whole list.  Block i's rows are copied (cp.async) into the stage while block
        i-1 is computed, then decoded into KVs; rowS holds the row numbers of blocks i and i+1."""
        tx = T.get_thread_binding()
        Qs = T.alloc_shared((HB, d), bf)
        KVs = T.alloc_shared((BLOCK, d), bf)
        Ps = T.alloc_shared((HB, BLOCK), bf)
        stage = T.alloc_shared((BLOCK, d), stage_t)
        stage_s = T.alloc_shared((BLOCK, d // 16), "uint8")
        rowS = T.alloc_shared((2, BLOCK), "int32")  # rows of blocks i, i+1 (by parity), -1 for none
        kindS = T.alloc_shared((2, 2), "int32") if uni else None  # their row kinds, by warp (set_row)
        Sf = T.alloc_fragment((HB, BLOCK), f32)
        acc = T.alloc_fragment((HB, d), f32)
        # running max, sum (the thread's part until the loop ends) and rescale of the thread's two
        # rows (`_SOFTMAX_PRELUDE`); the warpgroups' row maxima or sums
        mrun, den, alpha = (T.alloc_local((2,), f32) for _ in range(3))
        xch = T.alloc_shared((2 * HB,), f32)
        cb = T.alloc_local((vec,), "uint8")  # one item's codes
        cbs = T.alloc_local((UG, vec), "uint8") if uni else None  # a group's codes and scale bytes
        scs = T.alloc_local((UG,), "uint32") if uni else None
        vl = T.alloc_local((vec,), bf)
        nxt = T.alloc_local((1,), "int32")
        # the run's first block and length, made once: as expressions, the division by NS was
        # redone in the loop, there a 64-bit one (a subroutine call) inside the list-entry index
        blk0 = T.alloc_var("int32")
        nb = T.alloc_var("int32")
        mark(0, timer=_TRACE_T0)
        blk0 = bj * T.ceildiv(T.ceildiv(K, BLOCK), NS) if split else 0
        nb = T.max(T.min(T.ceildiv(T.ceildiv(K, BLOCK), NS), T.ceildiv(K, BLOCK) - blk0), 0) if split \
            else T.ceildiv(K, BLOCK)
        if tx < BLOCK:
            next_row(R, nxt, bb, bs, blk0, tx)
            set_row(R, rowS, kindS, 0, nxt[0], tx)
            next_row(R, nxt, bb, bs, blk0 + 1, tx)
        T.sync_threads()
        mark(1)
        if nb > 0:  # the first block's copies run while q is loaded
            issue_block(R, stage, stage_s, rowS, kindS, 0, bb, tx)
        if H % HB == 0:  # q by cp.async too: no thread waits for its loads before block 0's wait
            # (q by TMA boxes behind an mbarrier was timed 0.96x on an H100, BENCHMARKS.md)
            for u in T.unroll(HB * per_row // threads):
                h, c = (u * threads + tx) // per_row, (u * threads + tx) % per_row * vec  # (expressions)
                cp_async(16, Qs[h, c], R["Q"][bb, bs, bh * HB + h, c])
            T.ptx_commit_group()
        else:  # the last CTA's missing heads are zero rows of the GEMM, never stored
            for u in T.serial(T.ceildiv(HB * per_row, threads)):
                h, c = (u * threads + tx) // per_row, (u * threads + tx) % per_row * vec  # (expressions)
                if (u * threads + tx) < HB * per_row:
                    for j in T.vectorized(vec):
                        Qs[h, c + j] = T.if_then_else(bh * HB + h < H, R["Q"][bb, bs, bh * HB + h, c + j],
                                                      T.Cast(bf, 0))
        T.fill(acc, 0)
        T.fill(den, 0)
        T.fill(mrun, _f32_const(_NEG_BIG))
        mark(2)
        for i in T.serial(nb):
            T.ptx_wait_group(0)
            T.sync_threads()  # block i staged (every thread's copies); the previous GEMMs done with KVs
            mark_block(i, 0)
            decode(stage, stage_s, rowS, kindS, i % 2, KVs, cb, cbs, scs, vl, tx)
            if tx < BLOCK:  # rowS[(i+1) % 2] was last read by block i-1's masks
                set_row(R, rowS, kindS, (i + 1) % 2, nxt[0], tx)
                next_row(R, nxt, bb, bs, blk0 + i + 2, tx)
            T.sync_threads()  # KVs and rowS ready, the stage free
            mark_block(i, 1)
            if i + 1 < nb:  # block i+1's copies, in flight during block i's GEMMs
                issue_block(R, stage, stage_s, rowS, kindS, (i + 1) % 2, bb, tx)
            T.gemm(Qs, KVs, Sf, transpose_B=True, clear_accum=True)
            mark_block(i, 2)
            T.call_extern("handle", "dsv41c_softmax_block", Sf.data, T.address_of(rowS[i % 2, 0]),
                          T.address_of(mrun[0]), T.address_of(den[0]), T.address_of(alpha[0]),
                          T.address_of(xch[0]), _f32_const(scale))
            T.copy(Sf, Ps)
            T.call_extern("handle", "dsv41c_rows_scale<false>", acc.data, T.address_of(alpha[0]), nacc)
            mark_block(i, 3)
            T.gemm(Ps, KVs, acc)
            mark_block(i, 4)
        T.ptx_wait_group(0)  # (a run of no blocks never waited: q's copies land before its tile is reused)
        T.call_extern("handle", "dsv41c_row_total", T.address_of(den[0]), T.address_of(xch[0]))
        mark(28)
        rows = [0, 1]  # the thread's rows: head[k] (a list: unrolled at trace time)
        head = [16 * (tx % 128 // 32) + tx % 32 // 4 + 8 * k for k in rows]
        if pair:
            pair_merge(R, acc, mrun, den, head, bj, bs, bb, bh, tx)
        elif split:  # unnormalised: the combine rescales every split to the final max
            if tx % 4 == 0 and tx < 128:  # one thread of each row's eight stores its max and sum
                for k in rows:
                    if bh * HB + head[k] < H:
                        R["MP"][bb, bs, bj, bh * HB + head[k]] = mrun[k]
                        R["LP"][bb, bs, bj, bh * HB + head[k]] = den[k]
            if H % HB == 0:
                T.copy(acc, R["OP"][bb, bs, bj, bh * HB:(bh + 1) * HB, :])
            else:
                for h, c in T.Parallel(HB, d):
                    if bh * HB + h < H:
                        R["OP"][bb, bs, bj, bh * HB + h, c] = acc[h, c]
        else:
            for k in rows:
                den[k] = den[k] + T.exp(R["SINK"][T.min(bh * HB + head[k], H - 1)] - mrun[k])
            T.call_extern("handle", "dsv41c_rows_scale<true>", acc.data, T.address_of(den[0]), nacc)
            if H % HB == 0:
                T.copy(acc, R["O"][bb, bs, bh * HB:(bh + 1) * HB, :])
            else:
                for h, c in T.Parallel(HB, d):
                    if bh * HB + h < H:
                        R["O"][bb, bs, bh * HB + h, c] = T.Cast(bf, acc[h, c])
        mark(29, timer=_TRACE_T1)

    qt, st, it = T.Tensor((B, S, H, d), bf), T.Tensor((H,), f32), T.Tensor((B, S, K), "int32")
    wt = T.Tensor((B, N, d), "uint8" if kind == "packed_fp8" else bf)
    wst = T.Tensor((B, N, d // 32), "uint8")
    ct, cst = T.Tensor((B, NC, d // 2), "uint8"), T.Tensor((B, NC, d // 16), "uint8")
    # outputs: o [B,S,H,d] bf16, or the partials: acc [B,S,NS,H,d] fp32 and max, sum [B,S,NS,H] fp32
    # (one annotation object per parameter: two parameters given the same one become one buffer)
    ot, opt = T.Tensor((B, S, H, d), bf), T.Tensor((B, S, NP, H, d), f32)
    mpt, lpt = T.Tensor((B, S, NP, H), f32), T.Tensor((B, S, NP, H), f32)

    prelude = _SOFTMAX_PRELUDE + ("" if kind == "plain" else _ROW8_PRELUDE + _KINDS_PRELUDE) + \
        (cuda_trace_prelude(_TRACE, TRACE_SLOTS, _TRACE_SM) if _TRACE else "")

    @T.macro
    def run(R):
        if split:  # (pair: in clusters of two, with the merge's prelude)
            with T.Kernel(NS, S, B * HG, threads=threads, prelude=prelude + (_PAIR_PRELUDE if pair else ""),
                          **({"cluster_dims": (2, 1, 1)} if pair else {})) as (bj, bs, bz):
                TCU.pdl_trigger()  # the combine kernel may launch once every CTA of this one has started
                attend(R, bj, bs, bz // HG, bz % HG)
        else:
            with T.Kernel(S, B, HG, threads=threads, prelude=prelude) as (bs, bb, bh):
                attend(R, 0, bs, bb, bh)

    if kind == "plain" and split:
        @T.prim_func
        def main(Q_: qt, KV: wt, IDX: it, OP: opt, MP: mpt, LP: lpt, NV: T.int32):
            run({"Q": Q_, "KV": KV, "IDX": IDX, "OP": OP, "MP": MP, "LP": LP, "NV": NV})
    elif kind == "plain":
        @T.prim_func
        def main(Q_: qt, KV: wt, SINK: st, IDX: it, O: ot, NV: T.int32):
            run({"Q": Q_, "KV": KV, "SINK": SINK, "IDX": IDX, "O": O, "NV": NV})
    elif kind == "packed_rows" and split:
        @T.prim_func
        def main(Q_: qt, W: wt, CC: ct, CS: cst, IDX: it, OP: opt, MP: mpt, LP: lpt, NV: T.int32):
            run({"Q": Q_, "W": W, "CC": CC, "CS": CS, "IDX": IDX, "OP": OP, "MP": MP, "LP": LP, "NV": NV})
    elif kind == "packed_rows":
        @T.prim_func
        def main(Q_: qt, W: wt, CC: ct, CS: cst, SINK: st, IDX: it, O: ot, NV: T.int32):
            run({"Q": Q_, "W": W, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O, "NV": NV})
    elif split:
        @T.prim_func
        def main(Q_: qt, W: wt, WS: wst, CC: ct, CS: cst, IDX: it, OP: opt, MP: mpt, LP: lpt, NV: T.int32):
            run({"Q": Q_, "W": W, "WS": WS, "CC": CC, "CS": CS, "IDX": IDX, "OP": OP, "MP": MP, "LP": LP, "NV": NV})
    else:
        @T.prim_func
        def main(Q_: qt, W: wt, WS: wst, CC: ct, CS: cst, SINK: st, IDX: it, O: ot, NV: T.int32):
            run({"Q": Q_, "W": W, "WS": WS, "CC": CC, "CS": CS, "SINK": SINK, "IDX": IDX, "O": O, "NV": NV})
    return main


def _combine_prim_func(H, d):
    """o = sum_j acc_j e^(m_j - M) / (sum_j l_j e^(m_j - M) + e^(sink - M)), M = max_j m_j, in bf16:
    the splits' partials [B,S,NS,H,(d)] merged; grid (H, S, B), d/4 threads of 4 columns.  The
    splits are read `_COMBINE_UNROLL` at a time, so that many loads are in flight (NS is dynamic):
    each group's maxima, sums and partials loaded together, the group merged into a running max
    (one round trip to L2 a group; a first pass for M took one more: 1.04x at batch 32 on an
    H100).  With NS no more than that, as at batch 32, M is the running max after the one group,
    and the sums run in the same order as in the formula above."""
    B, S, NS = T.dynamic("B"), T.dynamic("S"), T.dynamic("NS")
    vec, unroll, f32 = 4, _COMBINE_UNROLL, "float32"

    @T.prim_func
    def main(OP: T.Tensor((B, S, NS, H, d), f32), MP: T.Tensor((B, S, NS, H), f32),
             LP: T.Tensor((B, S, NS, H), f32), SINK: T.Tensor((H,), f32), O: T.Tensor((B, S, H, d), "bfloat16")):
        with T.Kernel(H, S, B, threads=d // vec) as (h, bs, bb):
            tx = T.get_thread_binding()
            TCU.pdl_sync()  # launched early (programmatic launch): wait for the partials
            acc = T.alloc_local((vec,), f32)
            part = T.alloc_local((unroll, vec), f32)
            w = T.alloc_local((unroll,), f32)
            mp = T.alloc_local((unroll,), f32)
            lp = T.alloc_local((unroll,), f32)
            ov = T.alloc_local((vec,), "bfloat16")
            m = T.alloc_var(f32)
            mg = T.alloc_var(f32)
            den = T.alloc_var(f32)
            m = _f32_const(_NEG_BIG)
            den = T.float32(0)
            T.clear(acc)
            for j0 in T.serial(T.ceildiv(NS, unroll)):
                for u in T.unroll(unroll):  # the group's loads first
                    mp[u] = _f32_const(_NEG_BIG)
                    lp[u] = T.float32(0)
                    for v in T.unroll(vec):
                        part[u, v] = T.float32(0)
                    if j0 * unroll + u < NS:
                        mp[u] = MP[bb, bs, j0 * unroll + u, h]
                        lp[u] = LP[bb, bs, j0 * unroll + u, h]
                        for v in T.vectorized(vec):
                            part[u, v] = OP[bb, bs, j0 * unroll + u, h, tx * vec + v]
                mg = m
                for u in T.unroll(unroll):
                    mg = T.max(mg, mp[u])
                if j0 > 0:  # (the first group: nothing to rescale)
                    den = den * T.exp(m - mg)
                    for v in T.unroll(vec):
                        acc[v] = acc[v] * T.exp(m - mg)
                for u in T.unroll(unroll):
                    w[u] = T.float32(0)
                    if j0 * unroll + u < NS:
                        w[u] = T.exp(mp[u] - mg)
                        den = den + lp[u] * w[u]
                for u in T.unroll(unroll):
                    if j0 * unroll + u < NS:
                        for v in T.unroll(vec):
                            acc[v] = acc[v] + part[u, v] * w[u]
                m = mg
            den = den + T.exp(SINK[h] - m)
            for v in T.unroll(vec):
                ov[v] = T.Cast("bfloat16", acc[v] / den)
            for v in T.vectorized(vec):
                O[bb, bs, h, tx * vec + v] = ov[v]

    return main


# ------------------------------------------------------------------------------------- builds

def attention_prim_func(kind: str, dtype: str, H: int, d: int, scale: float, target: str, split: bool = False,
                        pair: bool = False):
    """The prim_func of one op variant: kind in KINDS, dtype "float32"/"bfloat16", target "c"/"cuda";
    split (CUDA only): the kernel writing one split's partials, merged by `combine_prim_func`."""
    if kind not in KINDS or dtype not in ("float32", "bfloat16") or H < 1 or d < 1:
        raise ValueError(f"sparse_attn kernels: unknown kind/dtype/shape {kind!r}/{dtype!r}/H={H}/d={d}")
    if target == "c":
        if split:
            raise ValueError("sparse_attn kernels: the C build has no split variant")
        return _cpu_prim_func(kind, dtype, H, d, scale)
    return _cuda_prim_func(kind, H, d, scale, split, pair)


def combine_prim_func(H: int, d: int):
    """The CUDA kernel merging the splits' partials into o (bf16)."""
    return _combine_prim_func(H, d)


@functools.lru_cache(maxsize=None)
def build(kind: str, dtype: str, H: int, d: int, scale: float, target: str, split: bool = False,
          pair: bool = False):
    """Compiled kernel, once per process per key; target "c" (CPU) or "cuda[:sm_XX]"; kind "combine"
    is the merge of a split call (dtype and scale unused)."""
    if kind == "combine":
        return compile_for(combine_prim_func(H, d), target)
    fn = attention_prim_func(kind, dtype, H, d, scale, "c" if target == "c" else "cuda", split, pair)
    return compile_for(fn, target)


def num_splits(ctas: int, blocks: int, sms: int) -> int:
    """CTAs per query (NS) for a CUDA call of `ctas` = B*S*HG query-head groups over lists of `blocks`
    blocks on `sms` SMs (one CTA per SM fits).  1 (no split, no partials) once the groups alone fill
    the SMs; otherwise the fewest blocks per CTA that keep every CTA in one wave, since a CTA's
    blocks run one after another and every split costs a partial [HB, d] fp32 write and read."""
    if ctas >= sms or blocks <= 1:
        return 1
    per_cta = next(n for n in range(1, blocks + 1) if ctas * -(-blocks // n) <= sms)
    return -(-blocks // max(per_cta, _MIN_SPLIT_BLOCKS))


def pair_merged(ns: int, blocks: int) -> bool:
    """Whether a split into ns CTAs per query over lists of `blocks` blocks merges its partials in
    clusters of two (`_PAIR_MIN_BLOCKS`)."""
    return ns > 1 and ns % 2 == 0 and -(-blocks // ns) >= _PAIR_MIN_BLOCKS


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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
    kernel_key = (kind, _DTYPES[q.dtype], h, d, float(scale), target)
    # the last source (compressed rows, or the plain rows) is a cache read [:B, :n]: its buffer's
    # rows as allocated go in uncopied, with n, the rows entries may name, as a scalar argument
    nv = srcs[-1].shape[1]
    qa, *srcs = (_arg(t, target) for t in (q, *srcs[:-2], *map(rows_buffer, srcs[-2:])))
    sink, idx = _arg(sink, target), _arg(idx, target)
    ns, blocks = 1, -(-idx.shape[-1] // BLOCK)
    if target != "c":
        ns = num_splits(b * s * -(-h // _CUDA_HEADS), blocks, _sm_count(q.device.index))
    if ns == 1:
        build(*kernel_key)(qa, *srcs, sink, idx, _arg(out, target), nv)
        return out
    pair = pair_merged(ns, blocks)
    npart = ns // 2 if pair else ns
    acc = q.new_empty((b, s, npart, h, d), dtype=torch.float32)
    m, l = (q.new_empty((b, s, npart, h), dtype=torch.float32) for _ in range(2))
    build(*kernel_key, True, pair)(qa, *srcs, idx, acc, m, l, nv)
    build("combine", "bfloat16", h, d, 0.0, target)(acc, m, l, sink, out)
    return out


def _sparse_attn(q, kv, sink, idx, scale):
    b, s, h, d = _check_common("sparse_attn", q, sink, idx)
    _want("sparse_attn", "kv", kv, q.dtype, (b, None, d), q.device)
    return _run("plain", q, (kv,), sink, idx, scale)


def packed_head_dim_problem(d: int, cuda: bool) -> str | None:
    """Why `sparse_attn_packed` cannot take head dim d (on CUDA, or the CPU build), else None: the
    packed formats' scale blocks need a multiple of 32, the CUDA build's tiles a multiple of 128."""
    if d % 32:
        return f"d must be a multiple of 32 for the packed formats, got {d}"
    if cuda and d % 128:
        return f"the CUDA build needs d a multiple of 128 for the packed formats, got {d}"
    return None


def _sparse_attn_packed(q, window, window_scales, comp_codes, comp_scales, sink, idx, scale):
    op = "sparse_attn_packed"
    b, s, h, d = _check_common(op, q, sink, idx)
    if (problem := packed_head_dim_problem(d, q.is_cuda)) is not None:
        raise ValueError(f"{op}: {problem}")
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
