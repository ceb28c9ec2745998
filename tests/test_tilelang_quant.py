"""TileLang packed-KV kernels (tilelang_kernels/quant.py) against the torch refs of dsv41c/quant.py.

CPU tests run the C-target builds (compiled once per process by `build`'s cache); `gpu` tests run
the CUDA builds on the same cases and compare with the refs computed on CPU.  Inputs are fresh
random every run (the seed is in each failure message) plus planted edge cases: exact powers of
two, E4M3 / E2M1 rounding ties and their neighbours at the block's actual scale, saturation at and
beyond 448*s / 6*s, floor-clamped and subnormal scales, fp32 subnormals, +-0 and all-zero rows.
"""

import re
import secrets
import shutil

import pytest
import torch

from dsv41c import quant as Q
from dsv41c.tilelang_kernels import quant as K

FMTS = ("fp8", "fp4_e4m3", "mxfp4")
DTYPES = (torch.float32, torch.bfloat16)
REFS = {"fp8": (Q.fp8_quant_ref, Q.fp8_dequant_ref),
        "fp4_e4m3": (Q.fp4_e4m3_quant_ref, Q.fp4_e4m3_dequant_ref),
        "mxfp4": (Q.mxfp4_quant_ref, Q.mxfp4_dequant_ref)}
OPS = {f: (getattr(torch.ops.dsv41c, f"{f}_quant"), getattr(torch.ops.dsv41c, f"{f}_dequant")) for f in FMTS}
ROW_N = {"fp8": 512, "fp4_e4m3": 512, "mxfp4": 128}  # KV rows, compressed KV rows, index keys
ROW_BYTES = {"fp8": 528, "fp4_e4m3": 288, "mxfp4": 68}
MAX_SCALED = {"fp8": 448.0, "fp4_e4m3": 6.0, "mxfp4": 6.0}
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fresh_seed() -> int:
    return secrets.randbits(31)


def e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite E4M3 magnitudes, ascending (fp32)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def ties(fmt: str) -> torch.Tensor:
    """Rounding decision points of the element code (in units of the block scale)."""
    if fmt == "fp8":
        g = e4m3_grid()
        return (g[1:] + g[:-1]) / 2
    return torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def bump(x: torch.Tensor, ulps: torch.Tensor) -> torch.Tensor:
    """x moved by `ulps` units in the last place of its own dtype (|x| > 0, same sign)."""
    return (x.view(INT[x.dtype]) + ulps.to(INT[x.dtype])).view(x.dtype)


def block_scale(fmt: str, amax: torch.Tensor) -> torch.Tensor:
    """The ref's block scale (fp32) for blocks whose amax is `amax` (1-D)."""
    block = K.FORMATS[fmt]
    row = torch.zeros(amax.numel(), block)
    row[:, 0] = amax
    _, s = REFS[fmt][0](row)
    s = s[:, 0]
    return s.view(torch.float8_e4m3fn).float() if fmt == "fp4_e4m3" else Q._e8m0_to_float(s)


def planted_block(fmt: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """One block whose elements sit on rounding ties (and one ulp off them) at the block's scale,
    with an amax at M * 2^k (M = 448 or 6, or 6 * an E4M3 value), a few ulps off, or far beyond."""
    block = K.FORMATS[fmt]
    k = int(torch.randint(-30, 30, (), generator=g))
    if fmt == "fp4_e4m3":
        grid = e4m3_grid()
        mid = (grid[1:] + grid[:-1]) / 2
        pick = torch.cat([grid[1:], mid])[torch.randint(0, 252, (), generator=g)]
        amax = 6.0 * pick  # a / 6 on an E4M3 value or on a tie between two (exact in fp32)
        if torch.rand((), generator=g) < 0.2:
            amax = amax * 2.0 ** float(torch.randint(3, 20, (), generator=g))  # scale saturates at 448
    else:
        amax = torch.tensor(MAX_SCALED[fmt] * 2.0**k)
    amax = bump(amax.reshape(1).to(dtype), torch.randint(-2, 3, (1,), generator=g)).float()
    s = block_scale(fmt, amax.to(dtype).float())
    t = ties(fmt)
    vals = (t[torch.randint(0, t.numel(), (block,), generator=g)] * s).to(dtype)
    vals = bump(vals, torch.randint(-1, 2, (block,), generator=g) * (vals != 0))
    vals = torch.minimum(vals.float().abs(), amax).to(dtype)
    vals[torch.randint(0, block, (), generator=g)] = amax.to(dtype)
    sign = torch.where(torch.rand(block, generator=g) < 0.5, -1.0, 1.0).to(dtype)
    return vals * sign


def make_rows(fmt: str, dtype: torch.dtype, rows: int, n: int, seed: int) -> torch.Tensor:
    """[rows, n] test rows in dtype: random rows of magnitudes 1e-8..1e4, mixed per-block
    magnitudes, planted tie blocks, and edge rows (zeros, -0, tiny, huge, floors, saturation)."""
    g = torch.Generator().manual_seed(seed)
    block, nb = K.FORMATS[fmt], n // K.FORMATS[fmt]
    x = torch.randn(rows, n, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 12 - 8)
    mixed = torch.exp2(torch.randint(-60, 61, (rows, nb, 1), generator=g).float())
    x = torch.where(torch.rand(rows, 1, 1, generator=g) < 0.3, x.reshape(rows, nb, block) * mixed,
                    x.reshape(rows, nb, block)).reshape(rows, n)
    pw = torch.rand(rows, n, generator=g) < 0.05  # exact powers of two, both signs
    p2 = torch.exp2(torch.randint(-140, 128, (rows, n), generator=g).float())
    x = torch.where(pw, torch.where(torch.rand(rows, n, generator=g) < 0.5, -p2, p2), x).to(dtype)
    for r in range(0, rows, 3):  # a third of the rows carry planted blocks
        for b in torch.randint(0, nb, (max(1, nb // 2),), generator=g).tolist():
            x[r, b * block:(b + 1) * block] = planted_block(fmt, dtype, g)
    tiny_blocks = (10.0 ** torch.randint(-44, -2, (nb, 1), generator=g).float()).expand(nb, block).reshape(n)
    edge = [
        torch.zeros(n),
        torch.full((n,), -0.0),
        torch.randn(n, generator=g) * 1e-41,  # fp32 subnormals only
        torch.randn(n, generator=g) * tiny_blocks,  # 1e-44 .. 1e-3, per block
        torch.randn(n, generator=g) * 1e37,  # near the fp32 maximum
        torch.full((n,), 3.0e38) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0),
        torch.randn(n, generator=g) * 5e-5,  # below the fp8 floor 1e-4
        torch.randn(n, generator=g) * 0.01,  # subnormal E4M3 scales
        torch.randn(n, generator=g) * 1e5,  # E4M3 scale saturated at 448
    ]
    for i, e in enumerate(edge[:rows]):
        x[rows - 1 - i] = e.to(dtype)
    z = torch.rand(rows, n, generator=g) < 0.02  # scattered signed zeros
    x = torch.where(z, torch.where(torch.rand(rows, n, generator=g) < 0.5, -0.0, 0.0).to(dtype), x)
    return x


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality; NaN positions only need to agree (payloads are platform-dependent)."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (what, got.dtype, got.shape, want.shape)
    got, want = got.cpu(), want.cpu()
    if got.dtype == torch.uint8:
        bad = (got != want).nonzero()
    else:
        nan_g, nan_w = torch.isnan(got), torch.isnan(want)
        bad = ((got.view(INT[got.dtype]) != want.view(INT[got.dtype])) & ~(nan_g & nan_w)).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} mismatches, first at {bad[:4].tolist()}: "
                              f"got {got[tuple(bad[:4].T)].tolist()} want {want[tuple(bad[:4].T)].tolist()}")


def check_quant(fmt, dtype, rows, n, device, seed):
    x = make_rows(fmt, dtype, rows, n, seed)
    q_ref, s_ref = REFS[fmt][0](x)
    q, s = OPS[fmt][0](x.to(device))
    assert_bits(q, q_ref, f"{fmt} {dtype} values, seed {seed}")
    assert_bits(s, s_ref, f"{fmt} {dtype} scales, seed {seed}")
    return q_ref, s_ref


def check_dequant(fmt, dtype, q, s, device, what):
    y = OPS[fmt][1](q.to(device), s.to(device), dtype == torch.bfloat16)
    assert_bits(y, REFS[fmt][1](q, s, dtype), f"{fmt} dequant to {dtype}, {what}")


def random_bytes(fmt, rows, n, seed):
    """Arbitrary value and scale bytes: every code, NaN codes, zero/NaN/negative/subnormal scales."""
    g = torch.Generator().manual_seed(seed)
    nv = n if fmt == "fp8" else n // 2
    q = torch.randint(0, 256, (rows, nv), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 256, (rows, n // K.FORMATS[fmt]), generator=g, dtype=torch.uint8)
    return q, s


# ----------------------------------------------------------------------------------- CPU (C target)

@pytest.fixture(scope="module", autouse=True)
def c_builds():
    """Every C build this file uses, compiled up front two at a time (about 1.5 s each)."""
    keys = [(f, d, t, ROW_N[f], "c") for f in FMTS for d in ("quant", "dequant")
            for t in ("float32", "bfloat16")]
    K.build_many(keys + [("mxfp4", "quant", "float32", 512, "c"), ("mxfp4", "dequant", "float32", 512, "c")])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_quant_bit_identical_cpu(fmt, dtype):
    seed = fresh_seed()
    q, s = check_quant(fmt, dtype, 53, ROW_N[fmt], "cpu", seed)
    for out in DTYPES:  # round trip of the ref's own codes
        check_dequant(fmt, out, q, s, "cpu", f"codes of seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_any_bytes_cpu(fmt, dtype):
    seed = fresh_seed()
    q, s = random_bytes(fmt, 41, ROW_N[fmt], seed)
    check_dequant(fmt, dtype, q, s, "cpu", f"random bytes of seed {seed}")


@pytest.mark.parametrize("fmt", FMTS)
def test_non_finite_blocks_cpu(fmt):
    """NaN / +-inf poison only their own block: scale 0xFF (UE8M0) / 0x7F (E4M3), dequant NaN."""
    seed = fresh_seed()
    x = make_rows(fmt, torch.float32, 6, ROW_N[fmt], seed)
    x[0, 3], x[1, 40], x[2, 77], x[3, :] = float("nan"), float("inf"), -float("inf"), float("nan")
    q, s = OPS[fmt][0](x)
    q_ref, s_ref = REFS[fmt][0](x)
    assert_bits(q, q_ref, f"{fmt} values, seed {seed}")
    assert_bits(s, s_ref, f"{fmt} scales, seed {seed}")
    y = OPS[fmt][1](q, s, False)
    block = K.FORMATS[fmt]
    bad = torch.zeros_like(x, dtype=torch.bool)
    for r, c in ((0, 3), (1, 40), (2, 77)):
        bad[r, c // block * block:(c // block + 1) * block] = True
    bad[3] = True
    assert torch.equal(torch.isnan(y), bad)


def e4m3_boundary_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows of fp4_e4m3 blocks whose quotients x / s sit within 3 fp32 ulps of an E2M1
    decision point, for every finite E4M3 scale s (the cases where a quotient computed from a
    rounded reciprocal could land on the wrong side; the CUDA build corrects it, Markstein).
    Returns the rows [R, 512] and the intended scale of each block."""
    g = torch.Generator().manual_seed(seed)
    scales = e4m3_grid()[1:]                                         # 126 scales
    x = scales[:, None, None] * ties("fp4_e4m3")[None, :7, None]     # [126, 7 ties, 7 bumps]
    x = bump(x.expand(-1, -1, 7), torch.arange(-3, 4).expand(126, 7, 7)).reshape(126, 49)
    amax = 6.0 * scales[:, None]                                    # E4M3(amax / 6) = s exactly
    x = torch.cat([x, (torch.rand(126, 7, generator=g) * 2 - 1) * amax], dim=1)  # 56 = 4 x 14
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x).reshape(126, 4, 14)
    blocks = torch.cat([amax[:, :, None].expand(-1, 4, 1), x, -amax[:, :, None].expand(-1, 4, 1) / 3], dim=2)
    blocks = blocks.reshape(-1, 16)                                 # [504, 16]
    pad = (-blocks.shape[0]) % 32
    blocks = torch.cat([blocks, blocks[:pad]])
    return blocks.reshape(-1, 512), torch.cat([scales.repeat_interleave(4), scales.repeat_interleave(4)[:pad]])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_fp4_e4m3_quotients_at_code_boundaries(device):
    seed = fresh_seed()
    x, want_scales = e4m3_boundary_rows(seed)
    q_ref, s_ref = REFS["fp4_e4m3"][0](x)
    assert torch.equal(s_ref.view(torch.float8_e4m3fn).float().reshape(-1), want_scales)
    q, s = OPS["fp4_e4m3"][0](x.to(device))
    assert_bits(q, q_ref, f"boundary quotients, seed {seed}")
    assert_bits(s, s_ref, f"boundary scales, seed {seed}")


@pytest.mark.parametrize("fmt", FMTS)
def test_packed_row_bytes_shapes_and_leading_dims(fmt):
    n = ROW_N[fmt]
    x = make_rows(fmt, torch.bfloat16, 6, n, fresh_seed()).reshape(2, 3, n)
    q, s = OPS[fmt][0](x)
    assert q.dtype == s.dtype == torch.uint8
    assert q.shape[:2] == s.shape[:2] == (2, 3)
    assert q.shape[-1] + s.shape[-1] == ROW_BYTES[fmt] == Q.packed_row_bytes(fmt, n)
    q_ref, s_ref = REFS[fmt][0](x)
    assert_bits(q, q_ref, fmt)
    assert_bits(s, s_ref, fmt)
    y = OPS[fmt][1](q, s, True)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert_bits(y, REFS[fmt][1](q_ref, s_ref, torch.bfloat16), fmt)


def test_dynamic_rows_one_build_per_key():
    """N is symbolic: row counts 1, 37 (not a tile multiple), a strided view and 0 share one build."""
    fmt, n = "mxfp4", 128
    OPS[fmt][0](torch.randn(1, n))
    before = K.build.cache_info().currsize
    big = make_rows(fmt, torch.float32, 37, 2 * n, fresh_seed())
    for x in (torch.randn(1, n), big[:, :n], big[:, n:]):
        q, s = OPS[fmt][0](x)
        q_ref, s_ref = REFS[fmt][0](x)
        assert_bits(q, q_ref, "values")
        assert_bits(s, s_ref, "scales")
    q, s = OPS[fmt][0](torch.randn(0, n))  # (the ref cannot reshape empty inputs)
    assert q.shape == (0, n // 2) and s.shape == (0, n // 32)
    assert OPS[fmt][1](q, s, False).shape == (0, n)
    assert K.build.cache_info().currsize == before


def test_other_row_lengths():
    """Any n divisible by the block: MXFP4 on KV-sized rows."""
    q, s = check_quant("mxfp4", torch.float32, 11, 512, "cpu", fresh_seed())
    check_dequant("mxfp4", torch.float32, q, s, "cpu", "n=512")


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 16"):
        OPS["fp4_e4m3"][0](torch.randn(2, 24))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        OPS["fp8"][0](torch.randn(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="do not match"):
        OPS["mxfp4"][1](torch.zeros(2, 60, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.mxfp4_dequant(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
                        torch.float16)


@pytest.mark.parametrize("fmt", FMTS)
def test_opcheck(fmt):
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    n = ROW_N[fmt]
    for dtype in DTYPES:
        x = make_rows(fmt, dtype, 5, n, fresh_seed()).reshape(5, 1, n)
        torch.library.opcheck(OPS[fmt][0], (x,), test_utils=utils)
        q, s = REFS[fmt][0](x)
        torch.library.opcheck(OPS[fmt][1], (q, s, dtype == torch.bfloat16), test_utils=utils)


# ----------------------------------------------------------------------------------- CUDA

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_source_is_coalesced(fmt):
    """The sm_90 builds compile, and each thread moves consecutive bf16 in 16-byte vectors (8 bf16;
    the fp4 quantisers read 16 bf16 as 8 words of two) and its packed bytes with one vector access,
    at offsets threadIdx.x * (values or words per thread) (a warp is contiguous)."""
    for direction in ("quant", "dequant"):
        src = K.build(fmt, direction, "bfloat16", ROW_N[fmt], "cuda:sm_90").get_kernel_source()
        x, v = ("X", "V") if direction == "quant" else ("Y", "Q")
        words = direction == "quant" and fmt != "fp8"
        vec, packed, step = ("int4", "uint2", 8) if words else ("uint4", "uint2" if fmt == "fp8" else "uint", 8)
        assert re.search(rf"\*\({vec}\*\)\({x} \+ .*threadIdx\.x\)\) \* \(int64_t\){step}\)", src), src
        pstep = 8 if fmt == "fp8" or words else 4
        assert re.search(rf"\*\({packed}\*\)\({v} \+ .*threadIdx\.x\)\) \* \(int64_t\){pstep}\)", src), src
        if direction == "quant" and K.FORMATS[fmt] > (16 if words else 8):  # a block spans lanes
            assert "__shfl_xor_sync" in src


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_bit_identical(fmt, dtype):
    n = ROW_N[fmt]
    for rows in (1, 37, 300):  # 37 * n / block is not a multiple of the 128-thread CTA
        seed = fresh_seed()
        q, s = check_quant(fmt, dtype, rows, n, "cuda", seed)
        for out in DTYPES:
            check_dequant(fmt, out, q, s, "cuda", f"codes of seed {seed}")
        qb, sb = random_bytes(fmt, rows, n, seed)
        check_dequant(fmt, dtype, qb, sb, "cuda", f"random bytes of seed {seed}")
    x = make_rows(fmt, dtype, 6, n, fresh_seed())
    x[0, 3], x[1, 40], x[2, 77] = float("nan"), float("inf"), -float("inf")
    q, s = OPS[fmt][0](x.cuda())
    q_ref, s_ref = REFS[fmt][0](x)
    assert_bits(q, q_ref, "non-finite values")
    assert_bits(s, s_ref, "non-finite scales")
    y = OPS[fmt][1](q, s, dtype == torch.bfloat16)
    assert torch.equal(torch.isnan(y).cpu(), torch.isnan(REFS[fmt][1](q_ref, s_ref, dtype)))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_leading_dims_and_opcheck(fmt):
    n = ROW_N[fmt]
    x = make_rows(fmt, torch.bfloat16, 6, n, fresh_seed()).reshape(2, 3, n).cuda()
    q, s = OPS[fmt][0](x)
    assert q.is_cuda and q.shape[-1] + s.shape[-1] == ROW_BYTES[fmt] and q.shape[:2] == (2, 3)
    y = OPS[fmt][1](q, s, True)
    assert y.is_cuda and y.shape == x.shape
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(OPS[fmt][0], (x,), test_utils=utils)
    torch.library.opcheck(OPS[fmt][1], (q, s, False), test_utils=utils)


def test_launcher_dispatch_cpu():
    """A C-target build is called through its library's entry (`CCall`), not TileLang's Cython
    adapter: the same bytes as the adapter's call, and every argument TileLang's adapter refuses
    is refused (ValueError, before the kernel runs), and more: a tensor on another device, and a
    number where a buffer goes (TileLang's adapter passes that on as an address); the launcher
    exposes the JITKernel's attributes."""
    launcher = K.build("fp8", "dequant", "float32", 512, "c")
    assert isinstance(launcher, K.Launcher) and isinstance(launcher.call, K.CCall)
    assert launcher.execution_backend == "cython"
    q, s = Q.fp8_quant_ref(torch.randn(300, 512))
    direct, wrapped = torch.full((300, 512), float("nan")), torch.full((300, 512), float("nan"))
    launcher(q, s, direct)
    launcher.kernel(q, s, wrapped)
    assert torch.equal(direct, wrapped) and torch.equal(direct, Q.fp8_dequant_ref(q, s, torch.float32))
    out = torch.empty(2, 512)
    good = (torch.zeros(2, 512, dtype=torch.uint8), torch.zeros(2, 16, dtype=torch.uint8), out)
    launcher(*good)
    bad = {"a static dim": (good[0], good[1], torch.empty(2, 256)),
           "the rank": (good[0], good[1], torch.empty(2, 1, 512)),
           "the dtype": (good[0], good[1], torch.empty(2, 512, dtype=torch.float64)),
           "a strided view": (good[0], good[1], torch.empty(512, 2).t()),
           "a missing argument": good[:2]}
    for what, args in bad.items():
        with pytest.raises(ValueError):
            launcher(*args)
            pytest.fail(f"{what} was not refused")
        with pytest.raises(ValueError):  # TileLang's own adapter refuses the same
            launcher.kernel(*args)
    for args in ((good[0], good[1], torch.empty(2, 512, device="meta")), (good[0], good[1], 0)):
        with pytest.raises(ValueError):
            launcher(*args)


def test_every_kernel_modules_c_builds_are_called_directly():
    """One C build of each kernel module, with its kinds of parameters (buffers with leading
    dynamic dims; attention's and the indexer's int32 scalars), takes the direct call, so no CPU
    op goes through TileLang's Cython adapter (`CCall.takes`)."""
    from dsv41c.tilelang_kernels import attention, indexer, mhc
    builds = [mhc.build("post_pre", "bfloat16", 4, 64, 1e-20, 1e-6, 20, "c")[0][1],
              attention.build("packed_fp8", "float32", 2, 64, 0.125, "c"),
              indexer.build("scores", (2, 64, True, True, True), "c"),
              indexer.build("select", ("topk", "all"), "c")]
    assert all(isinstance(b.call, K.CCall) for b in builds)
    select = builds[-1]   # (scores [B,S,N] as bf16 bits, visible lengths [S], out [B,S,k], k, offset)
    sc, vl, out = torch.zeros(1, 2, 8, dtype=torch.uint16), torch.full((2,), 8, dtype=torch.int32), \
        torch.empty(1, 2, 3, dtype=torch.int32)
    select(sc, vl, out, 3, 0)
    for k in (3.0, True, None, torch.tensor(3)):  # an int32 scalar takes a Python int only
        with pytest.raises(ValueError, match="expects a number"):
            select(sc, vl, out, k, 0)


@pytest.mark.gpu
@cuda
def test_cuda_launcher_calls_the_executable():
    """A CUDA build is called through its TVM-FFI executable, not TileLang's Python wrapper: the same
    bytes as the wrapper's call, on torch's current stream, and bad arguments still refused (by
    the executable's compiled checks)."""
    target = K.kernel_target(torch.empty(0, device="cuda"))
    launcher = K.build("fp8", "dequant", "bfloat16", 512, target)
    assert launcher.kernel.execution_backend == "tvm_ffi" and launcher.call is not launcher.kernel
    q, s = Q.fp8_quant_ref(torch.randn(300, 512))
    q, s = q.cuda(), s.cuda()
    direct, wrapped = (torch.full((300, 512), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in "ab")
    q_late = torch.zeros_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # q_late gets its codes only after ~25 ms on this stream: a kernel
        torch.cuda._sleep(50_000_000)  # launched on any other stream would decode its zeros
        q_late.copy_(q)
        launcher(q_late, s, direct)
    torch.cuda.current_stream().wait_stream(side)
    launcher.kernel(q, s, wrapped)
    torch.cuda.synchronize()
    assert torch.equal(direct.view(torch.int16), wrapped.view(torch.int16))
    assert torch.equal(direct.float().cpu(), Q.fp8_dequant_ref(q.cpu(), s.cpu(), torch.bfloat16).float())
    bad = [(q[:, :256].contiguous(), s, direct),                      # a static dim of the wrong size
           (q, s, direct.float()),                                     # the wrong dtype
           (q.cpu(), s, direct),                                       # the wrong device
           (q, s)]                                                     # an argument missing
    for args in bad:
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            launcher(*args)
