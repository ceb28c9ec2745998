"""TileLang kernels for the packed KV formats of MODEL.md §10: rows to packed bytes and back.

Ops (`torch.ops.dsv41c.*`), x [..., n] fp32 or bf16, n a multiple of the format's block:
  fp8_quant(x)      -> (E4M3 codes u8 [..., n], UE8M0 u8 [..., n/32])       512 -> 528 B (SWA KV)
  fp4_e4m3_quant(x) -> (packed E2M1 u8 [..., n/2], E4M3 u8 [..., n/16])   512 -> 288 B (compressed KV)
  mxfp4_quant(x)    -> (packed E2M1 u8 [..., n/2], UE8M0 u8 [..., n/32])  128 -> 68 B (index keys)
  <fmt>_dequant(values, scales, bf16) -> [..., n] in bfloat16 if bf16 else float32
E2M1 packing: element 2i in the low nibble, 2i+1 in the high nibble.

The torch references are `dsv41c.quant.<fmt>_quant_ref` / `<fmt>_dequant_ref`; the kernels are bit
identical to them, NaN policy included (a block with NaN or +-inf gets scale byte 0xFF (UE8M0) /
0x7F (E4M3) and codes 0x7F (fp8) / 0 (fp4), so it dequantises to NaN).  Dequantised NaNs agree in
position, not in payload bits.

How the kernels compute.  The C target has no fp8/fp4/bf16 types, so everything is integer
arithmetic on IEEE bit patterns, which also makes the CUDA and C builds agree by construction:
  * block amax = integer max of (bits & 0x7fffffff); >= 0x7f800000 means a non-finite block;
  * power-of-two scale: exponent of the fp32 product max(a, floor) * fp32(1/448 or 1/6), plus one
    if any mantissa bit is set; values are scaled by the exact 2^-k, which rounds like x / 2^k;
  * E4M3 scale of the fp4_e4m3 format: IEEE fp32 division a / 6 (as torch), then E4M3 encoding;
    values are divided by that scale (IEEE division, as torch);
  * E4M3 encoding: round-to-nearest-even after clamping the magnitude to 448: integer shifts in
    the normal range, in the subnormal range RNE(y * 2^9) by an fp32 addition of 2^23; E2M1 the
    same way (RNE on its grid is the spec's tie rule), saturating at code 7;
  * dequant builds the fp32 value from the code bits (E4M3: the bits at fp32 bias, times 2^120)
    and multiplies by the scale (fp32, exact except in the subnormal range, where IEEE rounding
    matches torch); bf16 output is rounded from the fp32 bits with integer round-to-nearest-even,
    as torch's scalar conversion does.
No fast math on either target (TileLang 0.1.15 defaults: nvcc without --use_fast_math, g++ -O0);
the few fp32 operations are exact or IEEE-rounded as stated and need fp32 subnormals (no FTZ/DAZ).

Layout of work.  CUDA: each thread owns chunks of 8 consecutive values of a row (16 B of bf16), so
a warp reads and writes contiguous memory with 16/8/4-byte vector accesses; 256 threads per CTA, 2
chunks per thread; a scale block spans 2 or 4 neighbouring lanes, whose amax is combined with
`__shfl_xor_sync`.  C target: one program per row, a serial loop over its blocks (the C target
has no threads).  N is a dynamic dimension (`T.dynamic`), so one build serves every row
count; a build is cached per (format, direction, dtype, n, target).  bf16 buffers are declared
`uint16` in the C build (the C codegen cannot print a bfloat16 type) and the op passes the tensor's
zero-copy uint16 view; the CUDA build takes bfloat16 buffers.
"""

import ctypes
import functools

import tilelang
import tilelang.cpu.language as TC
import tilelang.language as T
import torch

__all__ = ["FORMATS", "quant_prim_func", "build", "build_many", "fp8_quant", "fp8_dequant",
           "fp4_e4m3_quant", "fp4_e4m3_dequant", "mxfp4_quant", "mxfp4_dequant"]

FORMATS = {"fp8": 32, "fp4_e4m3": 16, "mxfp4": 32}  # format -> scale block along the last dim
_CUDA_THREADS = 256  # CUDA: threads per CTA
_UNROLL = 4  # CUDA: chunks per thread
_VEC = 8  # CUDA: consecutive values per chunk (16 B of bf16, 8 B of fp8 codes)
_WORD_VEC = 16  # CUDA, bf16 fp4 quantisers: values per chunk (32 B of bf16, 8 B of codes)


# ------------------------------------------------------------------------------------- CUDA device code
# shared by the kernel modules' preludes (`T.Kernel(..., prelude=...)`)

# two fp32 values rounded to nearest even into one word of two bf16 (lo in the low half)
CUDA_PACK_BF16X2 = """
__device__ __forceinline__ unsigned dsv41c_pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
"""


def trace_macros(on: bool):
    """The marks of a kernel's trace (`cuda_trace_prelude`), as TileLang macros: mark(k, who=0,
    timer=None), thread `who` stores its SM clock in slot k (and the global timer in slot `timer`);
    mark_first(i, k, n, who=0), the same for slot k while i < n (a loop's first n iterations).
    on False (the kernel module's `_TRACE` is 0): both emit nothing."""

    @T.macro
    def mark(k, who=0, timer=None):
        if on:
            if T.get_thread_binding() == who:
                T.call_extern("handle", "dsv41c_trace", k)
                if timer is not None:
                    T.call_extern("handle", "dsv41c_trace_timer", timer)

    @T.macro
    def mark_first(i, k, n, who=0):
        if on:
            if T.get_thread_binding() == who and i < n:
                T.call_extern("handle", "dsv41c_trace", k)

    return mark, mark_first


def cuda_trace_prelude(addr: int, slots: int, sm_slot: int) -> str:
    """A diagnostic (the kernel modules' `_TRACE`): dsv41c_trace(k) stores the calling thread's SM
    clock (clock64) in slot k of its CTA's row of the int64 buffer [CTAs, slots] at device address
    addr (CTAs in launch order: x fastest); dsv41c_trace_timer(k) stores the global timer (ns) in
    slot k and the SM number in slot sm_slot.  The kernel calls them from one thread a mark."""
    return r"""
__device__ __forceinline__ long long* dsv41c_trace_row() {
  return reinterpret_cast<long long*>(%dull) + %d * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}
__device__ __forceinline__ void dsv41c_trace(int k) {
  long long c;
  asm volatile("mov.u64 %%0, %%%%clock64;" : "=l"(c) :: "memory");
  dsv41c_trace_row()[k] = c;
}
__device__ __forceinline__ void dsv41c_trace_timer(int k) {
  long long g;
  unsigned sm;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(g) :: "memory");
  asm volatile("mov.u32 %%0, %%%%smid;" : "=r"(sm));
  dsv41c_trace_row()[k] = g;
  dsv41c_trace_row()[%d] = sm;
}
""" % (addr, slots, sm_slot)

# E2M1 codes to bf16 by bit moves: code nibble j of a 32-bit word (bits 4j..4j+3: sign bit 3,
# magnitude e1 e0 m) is element j of the word's 8.  Nibbles j and j + 4 go into one bf16x2 word by
# a shift and a mask: magnitude bits to bf16 bits 8..6 (exponent low bits and the top mantissa bit)
# and the sign to bit 15, which spells E2M1 x 2^-126 exactly (code 1, 0.5, becomes the bf16
# subnormal 2^-127); a bf16x2 multiply (which keeps subnormals) then applies 2^126 and a scale.
CUDA_E2M1_WORDS = r"""
// bf16x2 multiply, round to nearest even, subnormals kept (PTX mul.bf16x2 has no flush-to-zero).
__device__ __forceinline__ unsigned dsv41c_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Bits of b where the immediate mask m is set, of a elsewhere: one LOP3 (the compiler splits the
// C form into two, each taking one of m and ~m).
template <unsigned m>
__device__ __forceinline__ unsigned dsv41c_bitselect(unsigned a, unsigned b) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(d) : "r"(a), "r"(b), "n"(m));
  return d;
}

// Nibbles i and i + 4 of w (i = 0..3) as the bf16x2 x[i] of E2M1 x 2^-126 (bit moves only).  The
// sign of a nibble lies 6 bits further from its bf16 place than the magnitude, so a copy of each
// sign 6 bits above it (over bit 1 of a nibble the pair does not read) lets one shift and one mask
// move both: 12 integer ops a word instead of 15.  Nibbles 6 and 7 would need copies past bit 31,
// so pairs 2 and 3 shift right through a funnel with `hi` = w >> 26 above.  (Checked against the
// two-shift form on all 2^32 words.)
__device__ __forceinline__ void dsv41c_e2m1_words(unsigned w, unsigned* x) {
  const unsigned m = 0x81C081C0u;  // per half: sign (bit 15), magnitude (bits 8..6)
  unsigned s6 = w << 6;
  unsigned v01 = dsv41c_bitselect<0x22002200u>(w, s6);  // signs of nibbles 0, 1, 4, 5 at 9, 13, 25, 29
  unsigned v23 = dsv41c_bitselect<0x00220000u>(w, s6);  // signs of nibbles 2, 3 at 17, 21
  unsigned hi = w >> 26;                                     // signs of nibbles 6, 7 at 33, 37 of hi:v23
  x[0] = (v01 << 6) & m;
  x[1] = (v01 << 2) & m;
  x[2] = __funnelshift_r(v23, hi, 2) & m;
  x[3] = __funnelshift_r(v23, hi, 6) & m;
}

"""


def _f32_bits(v: float) -> int:
    """IEEE bits of fp32(v), the constant torch uses for a Python float scalar in fp32 maths."""
    return torch.tensor(v, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


# Float constants enter the kernels as bit patterns: the C codegen prints float immediates with
# 7 significant digits, which would change fp32(1/448).
_ABS, _INF, _NAN = 0x7FFFFFFF, 0x7F800000, 0x7FC00000
_B448 = _f32_bits(448.0)
_R448, _FP8_FLOOR = _f32_bits(1.0 / 448.0), _f32_bits(1e-4)
_R6, _MX_FLOOR = _f32_bits(1.0 / 6.0), _f32_bits(6.0 * 2.0**-126)
_E4M3_FLOOR, _SIX = _f32_bits(6.0 * 2.0**-9), _f32_bits(6.0)
_TWO, _TWO_P9, _TWO_P23, _TWO_P120, _TWO_P126 = (_f32_bits(2.0**k) for k in (1, 9, 23, 120, 126))
# E2M1 decision points (bits of 0.25 ... 5.0); True: a tie goes up (MODEL.md §10.1).
_E2M1_STEPS = tuple((_f32_bits(t), up) for t, up in ((0.25, False), (0.75, True), (1.25, False),
                                                     (1.75, True), (2.5, False), (3.5, True),
                                                     (5.0, False)))


# --------------------------------------------------------------------------- expression helpers
# Plain Python functions that build TIR expressions; called inside the kernels at trace time.
# Selection is T.Select: T.if_then_else on these uint32 conditions makes TVM's bound analysis build
# a negative uint32 literal and fail (TileLang 0.1.15).  Select evaluates both arms, so every arm is
# kept free of undefined behaviour (shift counts in range, unsigned wrap-around only).

def _u(v):
    return T.uint32(v)


def _f(bits):
    return T.reinterpret(bits, "float32")


def _bits(v):
    """fp32 bit pattern (uint32) of an element of an fp32, bf16 or uint16-holding-bf16 buffer."""
    if str(v.dtype) == "float32":
        return T.reinterpret(v, "uint32")
    if str(v.dtype) == "bfloat16":
        v = T.reinterpret(v, "uint16")
    return T.Cast("uint32", v) << _u(16)


def _store(dtype, f32):
    """The value stored for fp32 result f32 into a float32, bfloat16 or uint16 (bf16 bits) buffer."""
    if dtype == "float32":
        return f32
    b = T.reinterpret(f32, "uint32")
    rne = (b + _u(0x7FFF) + ((b >> _u(16)) & _u(1))) >> _u(16)  # c10::round_to_nearest_even
    h = T.Cast("uint16", T.Select((b & _u(_ABS)) > _u(_INF), _u(0x7FC0), rne))
    return h if dtype == "uint16" else T.reinterpret(h, "bfloat16")


def _flag(cond):
    return T.Cast("uint32", cond)


def _below(u, c, fcmp=False):
    """u < c for fp32 bit patterns u, c of non-negative values (u may be inf/NaN bits).  With fcmp
    the test is a float comparison (equal for these operands): in the CUDA build TVM rewrites an
    unsigned `u < c` into `u / c < 1`, which costs a multiply-high per element."""
    return _f(u) < _f(_u(c)) if fcmp else u < _u(c)


def _pow2_scale_exp(amax, floor, recip):
    """Biased exponent kb of s = 2^ceil(log2(max(a, floor) * recip)), read from the fp32 product."""
    t = T.reinterpret(_f(T.max(amax, _u(floor))) * _f(_u(recip)), "uint32")
    return ((t >> _u(23)) & _u(0xFF)) + _flag((t & _u(0x7FFFFF)) != _u(0))


def _e4m3_code(u, fcmp=False):
    """E4M3 magnitude code (0..0x7e) of the non-negative fp32 with bits u <= bits(448), RNE."""
    # subnormal range (u < 2^-6): code = RNE(u * 2^9) < 9, rounded by the fp32 addition of 2^23
    # (the product is exact, so an FMA contraction gives the same bits)
    sub = T.reinterpret(_f(u) * _f(_u(_TWO_P9)) + _f(_u(_TWO_P23)), "uint32") - _u(_TWO_P23)
    # normal range: rebias 127 -> 7 and round the 20 dropped mantissa bits to nearest even
    nor = (u - _u(120 << 23) + _u(0x7FFFF) + ((u >> _u(20)) & _u(1))) >> _u(20)
    return T.Select(_below(u, 0x3C800000, fcmp), sub, nor)


def _e4m3_value(c):
    """fp32 value of the E4M3 byte c (uint32 0..255): sign, subnormals, 0x7f/0xff -> NaN."""
    mag = c & _u(0x7F)
    # the code bits placed in an fp32 at exponent bias 127 (subnormal codes land on fp32
    # subnormals), rescaled by the exact 2^120 to bias 7
    v = T.reinterpret(_f(mag << _u(20)) * _f(_u(_TWO_P120)), "uint32") | ((c & _u(0x80)) << _u(24))
    return _f(T.Select(mag == _u(0x7F), _u(_NAN), v))


def _e8m0_value(c):
    """fp32 value of the UE8M0 byte c: 2^(c-127); 0 -> 2^-127 (subnormal), 255 -> NaN."""
    v = T.Select(c == _u(0), _u(0x400000), c << _u(23))
    return _f(T.Select(c == _u(255), _u(_NAN), v))


def _e2m1_code(v_bits, fcmp=False, saturate=True):
    """E2M1 magnitude code 0..7 of the non-negative fp32 with bits v_bits (>= 6 -> 7, NaN -> 7).

    Round to nearest even on the E2M1 grid, which is the spec's tie rule: below 1, code =
    RNE(v * 2) (0, 1, 2) by the fp32 addition of 2^23; from 1 up, rebias 127 -> 1 and round the
    22 dropped mantissa bits to nearest even; saturate at 7.  Equal, for every non-negative fp32
    bit pattern, to counting the thresholds in _E2M1_STEPS."""
    sub = T.reinterpret(_f(v_bits) * _f(_u(_TWO)) + _f(_u(_TWO_P23)), "uint32") - _u(_TWO_P23)
    nor = (v_bits - _u(126 << 23) + _u(0x1FFFFF) + ((v_bits >> _u(22)) & _u(1))) >> _u(22)
    code = T.Select(_below(v_bits, 0x3F800000, fcmp), sub, nor)
    return T.min(code, _u(7)) if saturate else code


def _e2m1_value(c):
    """fp32 value of the E2M1 code in the low nibble of c: magnitudes 0 .5 1 1.5 2 3 4 6, sign bit 8."""
    e, m = (c >> _u(1)) & _u(3), c & _u(1)
    mag = T.Select(e == _u(0), m * _u(0x3F000000), ((e + _u(126)) << _u(23)) | (m << _u(22)))
    return _f(mag | ((c & _u(8)) << _u(28)))


# --------------------------------------------------------------------------- per-block bodies
# Each macro handles scale block `b` of row `r`: (in0, in1/out, out, r, b).

def _scaled_bits(u, sc, fmt):
    """Bits of |x| / s: |x| * 2^-k for the power-of-two formats, IEEE |x| / s for fp4_e4m3."""
    a = _f(u & _u(_ABS))
    return T.reinterpret(a / sc if fmt == "fp4_e4m3" else a * sc, "uint32")


def _quant_macro(fmt):
    block = FORMATS[fmt]
    floor, recip = (_FP8_FLOOR, _R448) if fmt == "fp8" else (_MX_FLOOR, _R6)

    @T.macro
    def body(X, V, S, r, b):
        am = T.alloc_var("uint32")  # block amax, as fp32 bits
        sb = T.alloc_var("uint32")  # scale byte
        sc = T.alloc_var("float32")  # 2^-k for the power-of-two scales, the E4M3 scale s itself
        y0 = T.alloc_var("uint32")
        y1 = T.alloc_var("uint32")
        am = _u(0)
        for j in T.serial(block):
            am = T.max(am, _bits(X[r, b * block + j]) & _u(_ABS))
        if fmt == "fp4_e4m3":
            y0 = T.min(T.reinterpret(_f(T.max(am, _u(_E4M3_FLOOR))) / _f(_u(_SIX)), "uint32"), _u(_B448))
            sb = _e4m3_code(y0)
            sc = _e4m3_value(sb)
            S[r, b] = T.Cast("uint8", T.Select(am < _u(_INF), sb, _u(0x7F)))
        else:
            sb = _pow2_scale_exp(am, floor, recip)
            sc = _f((_u(254) - sb) << _u(23))  # 2^-k, a normal fp32 for every finite block
            S[r, b] = T.Cast("uint8", T.Select(am < _u(_INF), sb, _u(255)))
        if fmt == "fp8":
            for j in T.serial(block):
                y0 = T.min(_scaled_bits(_bits(X[r, b * block + j]), sc, fmt), _u(_B448))
                y1 = _e4m3_code(y0) | ((_bits(X[r, b * block + j]) >> _u(24)) & _u(0x80))
                V[r, b * block + j] = T.Cast("uint8", T.Select(am < _u(_INF), y1, _u(0x7F)))
        else:
            for i in T.serial(block // 2):
                y0 = _scaled_bits(_bits(X[r, b * block + 2 * i]), sc, fmt)
                y1 = _scaled_bits(_bits(X[r, b * block + 2 * i + 1]), sc, fmt)
                y0 = _e2m1_code(y0) | ((_bits(X[r, b * block + 2 * i]) >> _u(28)) & _u(8))
                y1 = _e2m1_code(y1) | ((_bits(X[r, b * block + 2 * i + 1]) >> _u(28)) & _u(8))
                y0 = y0 | (y1 << _u(4))
                V[r, b * (block // 2) + i] = T.Cast("uint8", T.Select(am < _u(_INF), y0, _u(0)))
    return body


def _dequant_macro(fmt, out_dtype):
    block = FORMATS[fmt]

    if fmt == "fp8":
        @T.macro
        def body(Q, S, Y, r, b):
            s = _e8m0_value(T.Cast("uint32", S[r, b]))
            for j in T.serial(block):
                v = _e4m3_value(T.Cast("uint32", Q[r, b * block + j]))
                Y[r, b * block + j] = _store(out_dtype, v * s)
        return body

    @T.macro
    def body(P, S, Y, r, b):
        c = T.Cast("uint32", S[r, b])
        s = _e8m0_value(c) if fmt == "mxfp4" else _e4m3_value(c)
        for i in T.serial(block // 2):
            p = T.Cast("uint32", P[r, b * (block // 2) + i])
            Y[r, b * block + 2 * i] = _store(out_dtype, _e2m1_value(p & _u(0xF)) * s)
            Y[r, b * block + 2 * i + 1] = _store(out_dtype, _e2m1_value(p >> _u(4)) * s)
    return body


# --------------------------------------------------------------------------- kernels

def _signature(fmt, direction, val_dtype, n):
    """Shapes and dtypes of the kernel's three buffers (in, in/out, out), N symbolic."""
    block = FORMATS[fmt]
    N = T.dynamic("N")
    vals = (N, n) if fmt == "fp8" else (N, n // 2)
    scales = (N, n // block)
    if direction == "quant":
        return N, [((N, n), val_dtype), (vals, "uint8"), (scales, "uint8")]
    return N, [(vals, "uint8"), (scales, "uint8"), ((N, n), val_dtype)]


def quant_prim_func(fmt: str, direction: str, dtype: str, n: int, target: str):
    """The TileLang prim_func for (format, "quant"/"dequant", "float32"/"bfloat16", n, "cuda"/"c")."""
    if fmt not in FORMATS or direction not in ("quant", "dequant"):
        raise ValueError(f"quant kernels: unknown format/direction {fmt!r}/{direction!r}")
    if dtype not in ("float32", "bfloat16") or n <= 0 or n % FORMATS[fmt]:
        raise ValueError(f"quant kernels: need dtype float32/bfloat16 and n a positive multiple of "
                         f"{FORMATS[fmt]} for {fmt}, got {dtype}, n={n}")
    cpu = target == "c"
    val_dtype = "uint16" if cpu and dtype == "bfloat16" else dtype
    body = _quant_macro(fmt) if direction == "quant" else _dequant_macro(fmt, val_dtype)
    nb = n // FORMATS[fmt]
    N, ((sa, ta), (sb, tb), (sc, tc)) = _signature(fmt, direction, val_dtype, n)

    if cpu:
        @T.prim_func
        def main(A: T.Tensor(sa, ta), B: T.Tensor(sb, tb), C: T.Tensor(sc, tc)):
            with TC.Kernel(N) as r:
                for b in T.serial(nb):
                    body(A, B, C, r, b)
        return main

    return _cuda_prim_func(fmt, direction, dtype, n)


def _cuda_prim_func(fmt, direction, dtype, n):
    """CUDA layout: each thread owns chunks of _VEC consecutive values of one row (16 B of bf16),
    so a warp's loads and stores are contiguous and 16/8/4-byte vectorised.  A CTA covers `rpc`
    rows x `ct` chunks (grid y splits rows longer than the tile); each thread handles _UNROLL
    chunks, one CTA-width apart, loading all of them before computing.  A scale block spans
    G = block/_VEC consecutive lanes: its amax is a shfl_xor butterfly over those lanes (every
    lane of the warp takes part, out-of-range lanes with amax 0) and its first lane stores the
    scale byte.

    Per element the CUDA build uses the hardware where it rounds exactly like the reference:
    E4M3 codes come from `cvt.rn.satfinite` (round to nearest even, saturating at 448) and go
    back through the exact E4M3 -> fp32 conversion; bf16 results are rounded by `cvt.rn.bf16`;
    the IEEE quotient |x| / s of the fp4_e4m3 format is one multiply by r = 1/s (rounded once)
    and two FMAs (Markstein: with r = RN(1/s) and q0 within an ulp of |x|/s, the residual
    |x| - q0 s is exact and RN(q0 + residual r) = RN(|x| / s)).  E2M1 has no conversion
    instruction on sm_90, so its codes use the integer rounding shared with the C build."""
    block = FORMATS[fmt]
    words = direction == "quant" and fmt != "fp8" and dtype == "bfloat16"
    # the bf16 fp4 quantisers take 16 values per chunk (a whole fp4_e4m3 block: no shuffles, one
    # scale per thread) and half as many chunks per thread
    vec, unroll = (_WORD_VEC, max(1, _UNROLL // 2)) if words else (_VEC, _UNROLL)
    G, cpr, tpb = max(1, block // vec), n // vec, _CUDA_THREADS
    tile = tpb * unroll
    ct = min(cpr, tile)
    rpc, gy = tile // ct, -(-cpr // ct)
    nv = _VEC if fmt == "fp8" else _VEC // 2  # value bytes per chunk
    N, ((sa, ta), (sb, tb), (sc, tc)) = _signature(fmt, direction, dtype, n)

    def at(u, tx, bx, by):
        """(row, chunk, in range) of chunk u of thread tx."""
        t = u * tpb + tx
        r, c = bx * rpc + t // ct, by * ct + t % ct
        ok = r < N
        if rpc * ct < tile:
            ok = ok & (t < rpc * ct)
        if gy * ct > cpr:
            ok = ok & (c < cpr)
        return r, c, ok

    esz = 4 if dtype == "float32" else 2
    if words:
        return _cuda_fp4_quant_bf16(fmt, n, N, at, rpc, gy, G, vec, unroll)

    if direction == "quant":
        floor, recip = (_FP8_FLOOR, _R448) if fmt == "fp8" else (_MX_FLOOR, _R6)

        @T.prim_func
        def main(X: T.Tensor(sa, ta), V: T.Tensor(sb, tb), S: T.Tensor(sc, tc)):
            with T.Kernel(T.ceildiv(N, rpc), gy, threads=tpb) as (bx, by):
                tx = T.get_thread_binding()
                xl = T.alloc_local((_UNROLL, _VEC), dtype)
                ql = T.alloc_local((_UNROLL, nv), "uint8")
                am = T.alloc_local((_UNROLL,), "uint32")
                sb = T.alloc_local((_UNROLL,), "uint32")
                sf = T.alloc_local((_UNROLL,), "float32")  # fp8: 2^-k (NaN for a non-finite block)
                rc = T.alloc_local((_UNROLL,), "float32")  # fp4 formats: 2^-k or RN(1/s)
                for u in T.unroll(_UNROLL):
                    r, c, ok = at(u, tx, bx, by)
                    if ok:
                        for h in T.unroll(_VEC * esz // 16):
                            for j in T.vectorized(16 // esz):
                                xl[u, h * (16 // esz) + j] = X[r, c * _VEC + h * (16 // esz) + j]
                for u in T.unroll(_UNROLL):
                    r, c, ok = at(u, tx, bx, by)
                    am[u] = _u(0)
                    if ok:
                        for j in T.unroll(_VEC):
                            am[u] = T.max(am[u], _bits(xl[u, j]) & _u(_ABS))
                    for k in T.unroll(G.bit_length() - 1):  # lanes c^1, c^2, .. of the scale block
                        am[u] = T.max(am[u], T.shfl_xor(am[u], 1 << k))
                    if fmt == "fp4_e4m3":
                        sb[u] = _e4m3_code(T.min(T.reinterpret(
                            _f(T.max(am[u], _u(_E4M3_FLOOR))) / _f(_u(_SIX)), "uint32"), _u(_B448)), True)
                        sf[u] = _e4m3_value(sb[u])
                        rc[u] = T.ieee_frcp(sf[u])
                        sb[u] = T.Select(_below(am[u], _INF, True), sb[u], _u(0x7F))
                    else:
                        sb[u] = _pow2_scale_exp(am[u], floor, recip)
                        rc[u] = _f((_u(254) - sb[u]) << _u(23))
                        sf[u] = _f(T.Select(_below(am[u], _INF, True), (_u(254) - sb[u]) << _u(23), _u(_NAN)))
                        sb[u] = T.Select(_below(am[u], _INF, True), sb[u], _u(255))
                    if fmt == "fp8":
                        for j in T.unroll(_VEC):
                            ql[u, j] = T.reinterpret(T.Cast("float8_e4m3fn", _f(_bits(xl[u, j])) * sf[u]), "uint8")
                    else:
                        for i in T.unroll(_VEC // 2):
                            ql[u, i] = T.Cast("uint8", T.Select(
                                _below(am[u], _INF, True),
                                _e2m1_signed(_bits(xl[u, 2 * i]), sf[u], rc[u], fmt)
                                | (_e2m1_signed(_bits(xl[u, 2 * i + 1]), sf[u], rc[u], fmt) << _u(4)),
                                _u(0)))
                    if ok:
                        for j in T.vectorized(nv):
                            V[r, c * nv + j] = ql[u, j]
                        if c % G == 0:
                            S[r, c // G] = T.Cast("uint8", sb[u])
        return main

    @T.prim_func
    def main(Q: T.Tensor(sa, ta), S: T.Tensor(sb, tb), Y: T.Tensor(sc, tc)):
        with T.Kernel(T.ceildiv(N, rpc), gy, threads=tpb) as (bx, by):
            tx = T.get_thread_binding()
            ql = T.alloc_local((_UNROLL, nv), "uint8")
            sl = T.alloc_local((_UNROLL,), "uint8")
            yl = T.alloc_local((_UNROLL, _VEC), dtype)
            sf = T.alloc_local((_UNROLL,), "float32")
            for u in T.unroll(_UNROLL):
                r, c, ok = at(u, tx, bx, by)
                if ok:
                    for j in T.vectorized(nv):
                        ql[u, j] = Q[r, c * nv + j]
                    sl[u] = S[r, c // G]
            for u in T.unroll(_UNROLL):
                r, c, ok = at(u, tx, bx, by)
                if ok:
                    sf[u] = (_e4m3_value(T.Cast("uint32", sl[u])) if fmt == "fp4_e4m3"
                             else _e8m0_value(T.Cast("uint32", sl[u])))
                    if fmt == "fp8":
                        for j in T.unroll(_VEC):
                            yl[u, j] = T.Cast(dtype, T.Cast("float32", T.reinterpret(ql[u, j], "float8_e4m3fn"))
                                              * sf[u])
                    else:
                        for i in T.unroll(_VEC // 2):
                            yl[u, 2 * i] = T.Cast(dtype, _e2m1_scaled(T.Cast("uint32", ql[u, i]), sf[u]))
                            yl[u, 2 * i + 1] = T.Cast(dtype, _e2m1_scaled(T.Cast("uint32", ql[u, i]) >> _u(4), sf[u]))
                    for h in T.unroll(_VEC * esz // 16):
                        for j in T.vectorized(16 // esz):
                            Y[r, c * _VEC + h * (16 // esz) + j] = yl[u, h * (16 // esz) + j]
    return main


def _cuda_fp4_quant_bf16(fmt, n, N, at, rpc, gy, G, vec, unroll):
    """bf16 rows to E2M1 on CUDA, reading the row as 32-bit words of two bf16 (the op passes an
    int32 view): the block amax takes one `__vmaxu2` (two 16-bit maxima) per word on the
    magnitude bits, each word yields one packed byte, and its two sign bits move into the nibbles
    with two shifts.  Same layout of work as `_cuda_prim_func`."""
    tpb, nw = _CUDA_THREADS, vec // 2

    @T.prim_func
    def main(X: T.Tensor((N, n // 2), "int32"), V: T.Tensor((N, n // 2), "uint8"),
             S: T.Tensor((N, n // FORMATS[fmt]), "uint8")):
        with T.Kernel(T.ceildiv(N, rpc), gy, threads=tpb) as (bx, by):
            tx = T.get_thread_binding()
            wl = T.alloc_local((unroll, nw), "int32")
            ql = T.alloc_local((unroll, nw), "uint8")
            am = T.alloc_local((unroll,), "uint32")
            sb = T.alloc_local((unroll,), "uint32")
            sf = T.alloc_local((unroll,), "float32")
            rc = T.alloc_local((unroll,), "float32")
            keep = T.alloc_local((unroll,), "uint32")
            wa = T.alloc_local((unroll, nw), "uint32")
            sc8 = T.alloc_local((unroll,), "float8_e4m3fn")
            for u in T.unroll(unroll):
                r, c, ok = at(u, tx, bx, by)
                if ok:
                    for j in T.vectorized(nw):
                        wl[u, j] = X[r, c * nw + j]
            for u in T.unroll(unroll):
                r, c, ok = at(u, tx, bx, by)
                am[u] = _u(0)
                if ok:
                    for j in T.unroll(nw):
                        wa[u, j] = T.reinterpret(wl[u, j], "uint32") & _u(0x7FFF7FFF)
                        am[u] = T.call_extern("uint32", "__vmaxu2", am[u], wa[u, j])
                am[u] = T.max(am[u] & _u(0xFFFF), am[u] >> _u(16)) << _u(16)
                for k in T.unroll(G.bit_length() - 1):
                    am[u] = T.max(am[u], T.shfl_xor(am[u], 1 << k))
                if fmt == "fp4_e4m3":
                    # E4M3(RN(amax / 6)) by the saturating RNE conversion, and back exactly
                    sc8[u] = T.Cast("float8_e4m3fn", _quotient(
                        _f(T.max(am[u], _u(_E4M3_FLOOR))), _f(_u(_SIX)), _f(_u(_R6)), fmt))
                    sb[u] = T.Cast("uint32", T.reinterpret(sc8[u], "uint8"))
                    sf[u] = T.Cast("float32", sc8[u])
                    rc[u] = T.ieee_frcp(sf[u])
                    sb[u] = T.Select(_below(am[u], _INF, True), sb[u], _u(0x7F))
                else:
                    sb[u] = _pow2_scale_exp(am[u], _MX_FLOOR, _R6)
                    rc[u] = _f((_u(254) - sb[u]) << _u(23))
                    sb[u] = T.Select(_below(am[u], _INF, True), sb[u], _u(255))
                keep[u] = T.Select(_below(am[u], _INF, True), _u(0xFF), _u(0))  # a non-finite block: codes 0
                for j in T.unroll(nw):
                    ql[u, j] = T.Cast("uint8", _e2m1_pair(T.reinterpret(wl[u, j], "uint32"), wa[u, j], sf[u], rc[u], fmt)
                                      & keep[u])
                if ok:
                    for j in T.vectorized(nw):
                        V[r, c * nw + j] = ql[u, j]
                    if c % G == 0:
                        S[r, c // G] = T.Cast("uint8", sb[u])
    return main


def _quotient(a, sf, rc, fmt):
    """|x| / s in fp32: a * 2^-k for the power-of-two scale (exact), or for the E4M3 scale the IEEE
    quotient by Markstein's correction of a * RN(1/s): with r = RN(1/s) and q0 within an ulp of
    a / s, the residual a - q0 s is exact and RN(q0 + residual r) = RN(a / s)."""
    q0 = a * rc
    if fmt == "fp4_e4m3":
        return T.ieee_fmaf(T.ieee_fmaf(-q0, sf, a), rc, q0)
    return q0


_FADD_K, _FADD_C = (1 << 23) - 2, (22 << 23) + 254


def _e2m1_fadd(q_bits):
    """E2M1 magnitude code of the non-negative fp32 q <= 6 (bits q_bits), by one fp32 addition,
    as (total, e) with code = total - e * _FADD_K - _FADD_C (uint32 arithmetic): with
    E = max(exponent of q, 127) and M = 2^(E - 105), the quantum of M's binade is the E2M1 step
    of q's binade (0.5 below 2, then 1, 2), so fl(q + M) - M rounds q onto the E2M1 grid to
    nearest even, and bits(fl(q + M)) - bits(M) counts steps above the binade's base, whose code
    is 2 (E - 127).  Checked against the threshold rule for every fp32 pattern in [0, 8].  The
    caller subtracts the affine part once per packed pair."""
    e = T.max(q_bits >> _u(23), _u(127))
    return T.reinterpret(_f(q_bits) + _f((e + _u(22)) << _u(23)), "uint32"), e


def _e2m1_pair(w, wa, sf, rc, fmt):
    """Packed byte of the two bf16 in the 32-bit word w (element 2i low, 2i+1 high nibble); wa is
    w with the two sign bits cleared.  The two codes are combined before their affine part is
    removed: lo + (hi << 4) = (t0 + (t1 << 4)) - (e0 + (e1 << 4)) K - 17 C, modulo 2^32.  The
    signs move to bits 3 and 7 by two shifts of w's sign bits; bits beyond the byte are cut by
    the uint8 store."""
    parts = []
    for bits in (wa << _u(16), wa & _u(0xFFFF0000)):
        q = T.reinterpret(_quotient(_f(bits), sf, rc, fmt), "uint32")
        if fmt == "fp4_e4m3":  # s is E4M3-rounded (or saturated at 448): q can pass 6; codes stop at 7
            q = T.min(q, _u(_SIX))
        parts.append(_e2m1_fadd(q))
    (t0, e0), (t1, e1) = parts
    codes = (t0 + (t1 << _u(4))) - (e0 + (e1 << _u(4))) * _u(_FADD_K) - _u((17 * _FADD_C) % 2**32)
    signs = w & _u(0x80008000)
    return codes | ((signs >> _u(12)) | (signs >> _u(24)))


def _e2m1_signed(xb, sf, rc, fmt):
    """Signed E2M1 nibble of the fp32 bits xb scaled by the block scale (CUDA build)."""
    a = _f(xb & _u(_ABS))
    if fmt == "fp4_e4m3":  # RN(a / s) by Markstein's correction of a * RN(1/s)
        q0 = a * rc
        q = T.ieee_fmaf(T.ieee_fmaf(-q0, sf, a), rc, q0)
    else:
        q = a * rc
    # an mxfp4 block needs no saturation: s >= amax / 6, so |x| / s <= 6 (code 7)
    code = _e2m1_code(T.reinterpret(q, "uint32"), fcmp=True, saturate=fmt == "fp4_e4m3")
    return code | ((xb >> _u(28)) & _u(8))


def _e2m1_scaled(c, sf):
    """fp32 value of the E2M1 code in the low nibble of c times the scale sf (CUDA build): the
    magnitude bits placed at fp32 bias land on 2^-126 times the value (code 1 on the subnormal
    2^-127), so one exact multiply by 2^126 rescales them."""
    mag = _f((c & _u(7)) << _u(22)) * _f(_u(_TWO_P126))
    return _f(T.reinterpret(mag, "uint32") | ((c & _u(8)) << _u(28))) * sf


_LIB = torch.library.Library("dsv41c", "FRAGMENT")


def define_op(name: str, schema: str, impl, fake):
    """Define `dsv41c::<name>` with the kernel wrapper `impl` for every backend and `fake` for
    tracing; returns the op. Shared by every kernel module.

    Through the dispatcher's own registration rather than `torch.library.custom_op`: that API
    wraps each call in a Python autograd layer and a Dynamo-disable frame, about 150 us of host
    time per call on an H200 host (221 us against 75 us for the wrapper alone, mhc_post_pre at one
    token), which a decode step pays at every site. The ops are functional and inference-only:
    they have no autograd formula (PyTorch's autograd fallback warns if a backward pass reaches
    one); the model runs under no_grad."""
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dsv41c::{name}", fake, lib=_LIB)
    return getattr(torch.ops.dsv41c, name).default


@functools.lru_cache(maxsize=None)
def build(fmt: str, direction: str, dtype: str, n: int, target: str):
    """Compiled kernel, once per process per key; target "c" (CPU) or "cuda" / "cuda:sm_XX"."""
    fn = quant_prim_func(fmt, direction, dtype, n, "c" if target == "c" else "cuda")
    return compile_for(fn, target)


NO_SYNC_ATTR = "dsv41c.no_thread_storage_sync"  # prim_func attr: TileLang inserts no barriers of its own
# prim_func attr: TileLang adds no bounds guards to the CUDA build's global accesses (the kernel
# guards every one itself, so TileLang's would be a second test and its address arithmetic)
NO_GUARD_ATTR = "dsv41c.no_safe_memory_access"
# The C builds' compiler flags (TileLang's own command has none, so gcc would not optimise).
C_FLAGS = ["-O3", "-ffp-contract=off"]


PDL_TAG = "tirx.use_programtic_dependent_launch"  # TVM's launch tag (its spelling) for a PDL launch


def _programmatic_launch_marked(lower_launch):
    """TileLang's `LowerDeviceKernelLaunch` pass followed by one that adds `PDL_TAG` to the launch
    parameters of every kernel that calls `pdl_sync` (TileLang marks those `has_cuda_pdl_sync`).
    TileLang 0.1.15 emits `cudaGridDependencySynchronize()` for `pdl_sync`, but its TVM-FFI path
    launches every kernel without the programmatic-serialization attribute, and without it the
    wait is a no-op and the launch is an ordinary stream-ordered one. With the tag, TVM's CUDA
    runtime launches the kernel through `cuLaunchKernelEx` with that attribute: its CTAs may start
    while the previous kernel on the stream finishes, and wait at `pdl_sync` until it has completed
    and its writes are visible."""
    import tvm

    def marked():
        @tvm.transform.module_pass(opt_level=0, name="dsv41c.MarkProgrammaticLaunch")
        def mark(mod, _ctx):
            for gv, f in list(mod.functions.items()):
                attrs = getattr(f, "attrs", None)
                if attrs is None or "has_cuda_pdl_sync" not in attrs or "tirx.kernel_launch_params" not in attrs:
                    continue
                tags = [str(t) for t in attrs["tirx.kernel_launch_params"]]
                if PDL_TAG not in tags:  # before the dynamic shared memory tag, which must be last
                    at = len(tags) - (tags[-1:] == ["tirx.use_dyn_shared_memory"])
                    mod[gv] = f.with_attr("tirx.kernel_launch_params", tags[:at] + [PDL_TAG] + tags[at:])
            return mod
        return tvm.transform.Sequential([lower_launch(), mark])
    marked.wrapped = lower_launch
    return marked


if not hasattr(tilelang.transform.LowerDeviceKernelLaunch, "wrapped"):  # once per process
    tilelang.transform.LowerDeviceKernelLaunch = _programmatic_launch_marked(tilelang.transform.LowerDeviceKernelLaunch)


def compile_for(fn, target: str):
    """tilelang.compile of a prim_func for target "c" (CPU) or "cuda[:sm_XX[a]]", without fast math
    (the kernels' exactness arguments assume IEEE fp32 operations), as a `Launcher`. Shared by every
    kernel module.
    A prim_func with the attr NO_SYNC_ATTR is compiled without TileLang's shared-memory barrier
    insertion: for a kernel that places every barrier itself (the mHC column-resident kernel,
    whose warp groups meet at named barriers), an inserted CTA-wide barrier costs time or
    deadlocks."""
    if target == "c":
        return Launcher(tilelang.compile(fn, target="c", compile_flags=C_FLAGS))
    arch = target.partition(":")[2]
    tgt = {"kind": "cuda", "arch": arch} if arch else "cuda"
    return Launcher(tilelang.compile(fn, target=tgt, pass_configs=cuda_pass_configs(fn)))


class Launcher:
    """A compiled TileLang kernel, called with every argument of its prim_func in order (outputs
    included: no kernel here has TileLang allocate its outputs). Shared by every kernel module.

    TileLang's own call (`JITKernel.__call__`, then its adapter's wrapper) rebuilds the argument
    list and looks for outputs to allocate on every call, so neither build goes through it:
    - A CUDA build runs through TileLang's TVM-FFI executable directly. The executable checks the
      arguments itself in its compiled host code (count, dtype, rank, static dims, device) and
      launches on torch's current stream.
    - A CPU build (the C target, whose TileLang adapter is the Cython one) is called through its
      shared library by `CCall`, which checks the arguments as that adapter does.
    Other attributes are the JITKernel's."""

    __slots__ = ("kernel", "call")

    def __init__(self, kernel):
        self.kernel = kernel
        adapter = kernel.adapter
        if kernel.execution_backend == "tvm_ffi" and not adapter.result_idx:
            self.call = adapter._get_executable()
        elif kernel.execution_backend == "cython" and CCall.takes(adapter):
            self.call = CCall(adapter)
        else:
            self.call = kernel

    def __call__(self, *args):
        return self.call(*args)

    def __getattr__(self, name):
        if name in Launcher.__slots__:  # not set yet
            raise AttributeError(name)
        return getattr(self.kernel, name)


class CCall:
    """The C build's `call` entry: the buffers' addresses and the scalars, in the prim_func's
    order, then each dynamic size read off the buffer that carries it (in the adapter's order),
    then a null stream. The arguments are checked as TileLang's Cython wrapper checks them (count,
    dtype, CPU, rank, static dims, contiguity; and a number for a scalar, where that wrapper would
    pass any number on, even for a buffer, as an address), so a wrong one is a ValueError, not a
    wild read. That wrapper cost a compiled tiny decode step about 105 us a kernel call, 41 calls
    a step (TileLang 0.1.15, BENCHMARKS.md: `benchmarks/c_calls.py`)."""

    __slots__ = ("lib", "specs", "sizes", "names")
    _SCALARS = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64, torch.float32: ctypes.c_float,
                torch.float64: ctypes.c_double}

    @staticmethod
    def _leading_dynamic(shape) -> int:
        """How many leading dims of a buffer's shape are dynamic, -1 if a later one is too."""
        k = next((d for d, n in enumerate(shape) if isinstance(n, int)), len(shape))
        return k if all(isinstance(n, int) for n in shape[k:]) else -1

    @staticmethod
    def takes(adapter) -> bool:
        """Whether every parameter is a buffer whose dynamic dims lead, or a scalar of `_SCALARS`,
        and every dynamic value is a size (not a stride)."""
        fn = adapter.prim_func
        return not adapter.result_idx and \
            all(entry[0] == 0 for entry in adapter.dynamic_symbolic_map.values()) and \
            all(CCall._leading_dynamic(kp.shape) >= 0 if p in fn.buffer_map else kp.torch_dtype() in CCall._SCALARS
                for p, kp in zip(fn.params, adapter.params, strict=True))

    def __init__(self, adapter):
        fn = adapter.prim_func
        self.lib = adapter.lib
        self.names = [str(fn.buffer_map[p].name) if p in fn.buffer_map else str(p.name) for p in fn.params]
        self.specs = []  # buffer: (dtype, rank, k, the static dims k.. as a tuple), dims below k dynamic;
        for p, kp in zip(fn.params, adapter.params, strict=True):  # scalar: (ctype, None, 0, None)
            if p in fn.buffer_map:
                k = CCall._leading_dynamic(kp.shape)
                self.specs.append((kp.torch_dtype(), len(kp.shape), k, tuple(kp.shape[k:])))
            else:
                self.specs.append((CCall._SCALARS[kp.torch_dtype()], None, 0, None))
        self.sizes = [(b, d) for _, b, d, _ in adapter.dynamic_symbolic_map.values()]

    def __call__(self, *args):
        if len(args) != len(self.specs):
            raise ValueError(f"TileLang C kernel: expected {len(self.specs)} arguments, got {len(args)}")
        out = []
        for a, (dtype, rank, k, tail), name in zip(args, self.specs, self.names, strict=True):
            if rank is None:  # a scalar of ctype `dtype`
                if not isinstance(a, int if dtype in (ctypes.c_int32, ctypes.c_int64) else (int, float)) or \
                        isinstance(a, bool):
                    raise ValueError(f"TileLang C kernel: argument {name} expects a number, got {type(a).__name__}")
                out.append(dtype(a))
            elif isinstance(a, torch.Tensor) and a.dtype == dtype and a.is_cpu and a.dim() == rank \
                    and a.shape[k:] == tail and a.is_contiguous():
                out.append(ctypes.c_void_p(a.data_ptr()))
            else:
                found = (f"{a.dtype} {tuple(a.shape)} on {a.device}{'' if a.is_contiguous() else ', strided'}"
                         if isinstance(a, torch.Tensor) else type(a).__name__)
                raise ValueError(f"TileLang C kernel: argument {name} expects a contiguous CPU {dtype} tensor "
                                 f"of rank {rank} ending in {tail}, got {found}")
        out += [ctypes.c_int64(args[b].shape[d]) for b, d in self.sizes]
        out.append(ctypes.c_void_p(0))
        if self.lib.call(*out) != 0:
            raise RuntimeError(f"TileLang C kernel failed: {self.lib.get_last_error().decode()}")


def cuda_pass_configs(fn) -> dict:
    """TileLang pass configs of a CUDA build of `fn` (compile_for's; also for lowering to source)."""
    configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}
    if fn.attrs is not None and NO_SYNC_ATTR in fn.attrs:  # the kernel places all its barriers itself
        configs[tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC] = True
    if fn.attrs is not None and NO_GUARD_ATTR in fn.attrs:  # the kernel guards all its accesses itself
        configs[tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
    return configs


def build_many(keys) -> None:
    """Compile several `build` keys, one after the other: TileLang parses kernel source with `ast`,
    and CPython 3.11's AST construction is not thread-safe ("AST constructor recursion depth
    mismatch" when two threads parse at once), so no thread pool here."""
    for key in keys:
        build(*key)


def kernel_target(t: torch.Tensor, family: str = "quant") -> str:
    """The build target for a tensor's device (`device_target`). Shared by every kernel module."""
    return device_target(t.device, family)


def device_target(device: torch.device, family: str = "quant") -> str:
    """The build target for a device: "c" (CPU) or "cuda:sm_XY", with Hopper's arch-specific suffix
    ("sm_90a": wgmma needs it)."""
    if device.type == "cpu":
        return "c"
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"{family} kernels: no build for device {device}")


@functools.cache
def _cuda_target(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda:sm_{major}{minor}" + ("a" if major == 9 else "")


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _kernel_view(t: torch.Tensor, target: str) -> torch.Tensor:
    """bf16 tensors go to the C build as their uint16 bits (zero-copy view)."""
    return t.view(torch.uint16) if target == "c" and t.dtype == torch.bfloat16 else t


def _aligned(t: torch.Tensor, target: str) -> torch.Tensor:
    """Inputs of the CUDA builds are read with 16/8/4-byte vector loads: a contiguous view at a
    storage offset that breaks 16-byte alignment is copied.  (Outputs are fresh allocations.)"""
    return t if target == "c" or t.data_ptr() % 16 == 0 else t.clone()


def rows_buffer(t: torch.Tensor) -> torch.Tensor:
    """The dense [B, capacity, c] rows a cache read [B, n, c] was sliced from, without a copy.

    A cache read is `buf[:B, :n]` of a [B_max, capacity, c] buffer: dense in its last two dims, its
    batch stride capacity x c.  The builds take dense tensors only, and copying the read costs the
    whole cache on every call (at 64K rows and batch 32, ~1 ms per call for a 600 MB FP4 cache).
    So the kernels get the buffer's rows and the number of valid rows separately.  Anything else
    (a view that is not such a slice) is returned contiguous, copied if need be."""
    if t.dim() != 3 or t.is_contiguous():
        return t.contiguous()
    b, n, c = t.shape
    s0, s1, s2 = t.stride()
    end = t.storage_offset() + (b - 1) * s0 + s0  # one past the widened view's last element
    if s2 != 1 or s1 != c or s0 % c or s0 < n * c or end > t.untyped_storage().nbytes() // t.element_size():
        return t.contiguous()
    return t.as_strided((b, s0 // c, c), (s0, c, 1))


def _blocks_of(fmt: str, n: int, name: str) -> int:
    if n % FORMATS[fmt]:
        raise ValueError(f"{fmt}: last dim of {name} must be a multiple of {FORMATS[fmt]}, got {n}")
    return n // FORMATS[fmt]


def _check_grid(fmt: str, rows: int, n: int) -> None:
    """The kernels index blocks with int32 (rows * n/block, the CUDA grid)."""
    if rows * (n // FORMATS[fmt]) >= 2**31:
        raise ValueError(f"{fmt}: {rows} rows of {n} are too many blocks for one launch (< 2^31)")


# --------------------------------------------------------------------------- torch.library ops

def _quant_fake(fmt, x):
    n = x.shape[-1]
    nb = _blocks_of(fmt, n, "x")
    vals = n if fmt == "fp8" else n // 2
    return (x.new_empty((*x.shape[:-1], vals), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], nb), dtype=torch.uint8))


def _quant(fmt, x):
    if x.dtype not in _DTYPES or x.dim() == 0:
        raise ValueError(f"{fmt}_quant: x must be fp32 or bf16 with a last dim, "
                         f"got {x.dtype} {tuple(x.shape)}")
    vals, scales = _quant_fake(fmt, x)
    n = x.shape[-1]
    if x.numel():
        target = kernel_target(x)
        x2 = _kernel_view(_aligned(x.reshape(-1, n).contiguous(), target), target)
        _check_grid(fmt, x2.shape[0], n)
        if target != "c" and fmt != "fp8" and x.dtype == torch.bfloat16:
            x2 = x2.view(torch.int32)  # the CUDA build reads bf16 pairs as 32-bit words
        build(fmt, "quant", _DTYPES[x.dtype], n, target)(x2, vals.view(x2.shape[0], -1),
                                                         scales.view(x2.shape[0], -1))
    return vals, scales


def _dequant_fake(fmt, values, scales, dtype):
    nb = scales.shape[-1] if scales.dim() else 0
    n = nb * FORMATS[fmt]
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{fmt}_dequant: values and scales must be uint8, "
                         f"got {values.dtype}, {scales.dtype}")
    if values.shape[:-1] != scales.shape[:-1] or values.shape[-1] != (n if fmt == "fp8" else n // 2):
        raise ValueError(f"{fmt}_dequant: values {tuple(values.shape)} do not match scales "
                         f"{tuple(scales.shape)} (block {FORMATS[fmt]})")
    return values.new_empty((*values.shape[:-1], n), dtype=dtype)


def _dequant(fmt, values, scales, dtype):
    out = _dequant_fake(fmt, values, scales, dtype)
    n = out.shape[-1]
    if out.numel():
        target = kernel_target(values)
        v2 = _aligned(values.reshape(-1, values.shape[-1]).contiguous(), target)
        _check_grid(fmt, v2.shape[0], n)
        s2 = scales.reshape(-1, scales.shape[-1]).contiguous()
        build(fmt, "dequant", _DTYPES[dtype], n, target)(v2, s2, _kernel_view(out.view(-1, n), target))
    return out


def _out_dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def dequant_flag(dtype: torch.dtype) -> bool:
    """The dequant ops' `bf16` argument for an output dtype (float32 or bfloat16)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dequant: dtype must be float32 or bfloat16, got {dtype}")
    return dtype == torch.bfloat16


def _register(fmt):
    q = define_op(f"{fmt}_quant", "(Tensor x) -> (Tensor, Tensor)", lambda x: _quant(fmt, x),
                  lambda x: _quant_fake(fmt, x))
    # the output dtype is a bool, not a ScalarType: torch 2.11's AOTInductor proxy executor reads a
    # ScalarType argument in the export schema's numbering (float32 arrives as float64)
    dq = define_op(f"{fmt}_dequant", "(Tensor values, Tensor scales, bool bf16) -> Tensor",
                   lambda values, scales, bf16: _dequant(fmt, values, scales, _out_dtype(bf16)),
                   lambda values, scales, bf16: _dequant_fake(fmt, values, scales, _out_dtype(bf16)))
    return q, dq


_OPS = {fmt: _register(fmt) for fmt in FORMATS}


def fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] fp32/bf16 -> (E4M3 codes u8 [..., n], UE8M0 bytes u8 [..., n/32]); = fp8_quant_ref."""
    return torch.ops.dsv41c.fp8_quant(x)


def fp8_dequant(values, scales, dtype=torch.float32) -> torch.Tensor:
    """Inverse of fp8_quant, in dtype (fp32 or bf16); = fp8_dequant_ref."""
    return torch.ops.dsv41c.fp8_dequant(values, scales, dequant_flag(dtype))


def fp4_e4m3_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (packed E2M1 u8 [..., n/2], raw E4M3 bytes u8 [..., n/16]); = fp4_e4m3_quant_ref."""
    return torch.ops.dsv41c.fp4_e4m3_quant(x)


def fp4_e4m3_dequant(values, scales, dtype=torch.float32) -> torch.Tensor:
    """Inverse of fp4_e4m3_quant, in dtype (fp32 or bf16); = fp4_e4m3_dequant_ref."""
    return torch.ops.dsv41c.fp4_e4m3_dequant(values, scales, dequant_flag(dtype))


def mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (packed E2M1 u8 [..., n/2], UE8M0 bytes u8 [..., n/32]); = mxfp4_quant_ref."""
    return torch.ops.dsv41c.mxfp4_quant(x)


def mxfp4_dequant(values, scales, dtype=torch.float32) -> torch.Tensor:
    """Inverse of mxfp4_quant, in dtype (fp32 or bf16); = mxfp4_dequant_ref."""
    return torch.ops.dsv41c.mxfp4_dequant(values, scales, dequant_flag(dtype))
