"""Tests of dsv41c.quant against the rules of MODEL.md §10 (formats, scales, packing, codecs)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv41c import quant as Q

NAN = float("nan")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FAKES = [  # name, fake quantiser, block, quant codec, dequant codec
    ("fp8", Q.fp8_fake_quant, 32, Q.fp8_quant_ref, Q.fp8_dequant_ref),
    ("fp4_e4m3", Q.fp4_e4m3_fake_quant, 16, Q.fp4_e4m3_quant_ref, Q.fp4_e4m3_dequant_ref),
    ("mxfp4", Q.fp4_ue8m0_fake_quant, 32, Q.mxfp4_quant_ref, Q.mxfp4_dequant_ref),
]
IDS = [f[0] for f in FAKES]
fast = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def rand(seed, *shape, block=16, spread=12, dtype=torch.float32):
    """Normal values with a random power-of-two magnitude per block of `block`, so scales vary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    e = torch.randint(-spread, spread + 1, (*shape[:-1], shape[-1] // block, 1), generator=g).float()
    return (x.reshape(*shape[:-1], -1, block) * torch.exp2(e)).reshape(shape).to(dtype)


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def assert_same(a, b):
    """Bitwise equality, except that NaN positions only need to agree."""
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb)
    assert torch.equal(bits(a)[~na], bits(b)[~nb])


def scales_of(name, s):
    """fp64 scales from a codec's raw scale bytes."""
    if name == "fp4_e4m3":
        return s.view(torch.float8_e4m3fn).double()
    return torch.exp2(s.double() - 127)


# ----------------------------------------------------------------------------------- E2M1 scalars

def test_e2m1_tie_table_and_saturation():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, 0.2499, 0.2501, 4.99, 5.01])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.0, 0.5, 4.0, 6.0])
    assert torch.equal(Q.e2m1_round(v), want)
    assert torch.equal(Q.e2m1_round(-v), -want)
    assert torch.signbit(Q.e2m1_round(torch.tensor([-0.1, -0.0]))).all()
    assert torch.isnan(Q.e2m1_round(torch.tensor([NAN]))).all()


def test_e2m1_every_value_round_trips_and_is_monotone():
    vals = torch.cat([E2M1, -E2M1])
    assert torch.equal(bits(Q.e2m1_round(vals)), bits(vals))
    grid = torch.linspace(-6.5, 6.5, 10401)  # contains every tie point exactly
    r = Q.e2m1_round(grid)
    assert (r[1:] >= r[:-1]).all()
    assert ((r - grid.clamp(-6, 6)).abs() <= torch.where(grid.abs() < 2, 0.25, torch.where(grid.abs() < 4, 0.5, 1.0))).all()


def test_e2m1_decode_every_code():
    """Codes 0..7 are the magnitudes, 8..15 their negatives (8 is -0.0)."""
    got = Q._e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(bits(got), bits(torch.cat([E2M1, -E2M1])))


def test_e2m1_round_traces_without_graph_breaks():
    f = torch.compile(Q.e2m1_round, fullgraph=True, backend="eager")
    v = torch.randn(257) * 4
    assert_same(f(v), Q.e2m1_round(v))
    g = torch.compile(Q.fp4_e4m3_fake_quant, fullgraph=True, backend="eager")
    x = rand(1, 4, 64)
    assert_same(g(x), Q.fp4_e4m3_fake_quant(x))


def test_pack_unpack_nibble_order():
    assert Q.pack_e2m1(torch.tensor([1, 2, 0xF, 0x8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = Q.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(packed & 0xF, codes[..., 0::2]) and torch.equal(packed >> 4, codes[..., 1::2])
    assert torch.equal(Q.unpack_e2m1(packed), codes)
    assert torch.equal(Q.unpack_e2m1(packed.view(torch.float4_e2m1fn_x2)), codes)
    with pytest.raises(ValueError):
        Q.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------------- scales

@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
def test_all_zero_rows_give_exact_zeros_and_floor_scales(name, fq, block, quant, dequant):
    x = torch.zeros(2, 64)
    assert_same(fq(x), x)
    assert_same(fq(x.bfloat16()), x.bfloat16())
    codes, s = quant(x)
    assert (codes == 0).all()
    floor_byte = {"fp8": 127 - 22, "fp4_e4m3": 0x01, "mxfp4": 1}[name]  # 2^-22, e4m3 2^-9, 2^-126
    assert (s == floor_byte).all()
    assert_same(dequant(codes, s), x)
    assert torch.signbit(fq(-x)).all()  # -0 keeps its sign


@given(k=st.integers(-20, 100))
@fast
def test_ue8m0_scale_at_exact_powers_of_two(k):
    for quant, top in ((Q.fp8_quant_ref, 448.0), (Q.mxfp4_quant_ref, 6.0)):
        a = torch.tensor(top * 2.0**k, dtype=torch.float32)
        for amax, want in ((a, 127 + k), (torch.nextafter(a, a * 2), 128 + k), (torch.nextafter(a, a * 0), 127 + k)):
            x = torch.zeros(32)
            x[5] = -amax
            assert quant(x)[1].item() == want


@given(seed=seeds)
@fast
def test_ue8m0_bit_rule_equals_exp2_ceil_log2(seed):
    x = rand(seed, 64, 32, block=32, spread=40)
    a = x.abs().amax(-1).numpy()
    for quant, floor, recip in ((Q.fp8_quant_ref, 1e-4, 1 / 448), (Q.mxfp4_quant_ref, 6 * 2.0**-126, 1 / 6)):
        t = np.maximum(a, np.float32(floor)) * np.float32(recip)  # fp32 product, as the kernels form it
        want = np.ceil(np.log2(t.astype(np.float64))) + 127
        assert np.array_equal(quant(x)[1][:, 0].numpy().astype(np.float64), want)


def test_fp8_saturation_and_extremes():
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, -448.0, 447.0  # scale 1, 447 -> 448 (RNE, step 32 above 256)
    x[1, :3] = torch.tensor([2.0**127, -1.7e38, 1e-30])  # |x| <= 2^127 stays finite
    y = Q.fp8_fake_quant(x)
    assert y[0, :3].tolist() == [448.0, -448.0, 448.0]
    assert torch.isfinite(y).all()
    assert ((y[1, :2] - x[1, :2]).abs() <= x[1, :2].abs() / 16).all() and y[1, 2] == 0


def test_fp4_saturation_at_6():
    x = torch.zeros(3, 32)
    x[0, :3] = torch.tensor([6.0, -6.0, 5.0])  # scale exactly 1; 5 is a tie -> 4
    x[1, :2] = torch.tensor([6.0001, 5.0])  # scale 2; 5/2 = 2.5 ties to 2
    y = Q.fp4_ue8m0_fake_quant(x)
    assert y[0, :3].tolist() == [6.0, -6.0, 4.0] and y[1, :2].tolist() == [6.0, 4.0]
    z = torch.zeros(3, 16)
    z[0, :2] = torch.tensor([6.36, -6.2])  # a/6 = 1.06 -> e4m3 1.0, x/s = 6.36 saturates to 6
    z[1, :2] = torch.tensor([1e6, 1000.0])  # scale saturates at 448: 1e6/448 -> 6, 1000/448 = 2.23 -> 2
    z[2, 0] = 3e38
    w = Q.fp4_e4m3_fake_quant(z)
    assert w[0, :2].tolist() == [6.0, -6.0] and w[1, :2].tolist() == [2688.0, 896.0] and w[2, 0] == 2688.0
    assert Q.fp4_e4m3_quant_ref(z)[1][:, 0].tolist() == [0x38, 0x7E, 0x7E]  # e4m3 1.0, 448, 448


def test_e4m3_scale_subnormal_floor():
    x = torch.zeros(4, 16)
    x[0, 0] = 0.001  # below 6*2^-9: s = 2^-9, 0.001/2^-9 = 0.512 -> 0.5
    x[1, 0] = 6 * 2.0**-9  # s = 2^-9, value exact
    x[2, 0] = 6 * 1.5 * 2.0**-9  # a/6 = 1.5*2^-9 ties between e4m3 subnormals 1 and 2 -> 2 (even)
    x[3, 0] = -6 * 2.0**-9 * 0.04  # x/s = -0.24 -> -0
    y = Q.fp4_e4m3_fake_quant(x)
    assert y[:, 0].tolist() == [2.0**-10, 6 * 2.0**-9, 4 * 2.0**-8, -0.0]  # row 2: x/s = 4.5 -> 4
    assert torch.signbit(y[3, 0])
    assert Q.fp4_e4m3_quant_ref(x)[1][:, 0].tolist() == [1, 1, 2, 1]


# ----------------------------------------------------------------------------------- exactness

@given(k=st.integers(-20, 60), seed=seeds)
@fast
def test_every_e4m3_value_round_trips(k, seed):
    g = torch.Generator().manual_seed(seed)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    rows = finite[torch.randint(0, len(finite), (len(finite), 32), generator=g)]
    rows[:, 0] = finite
    rows[torch.arange(len(finite)), torch.randint(1, 32, (len(finite),), generator=g)] = 0x7E  # 448: s = 1
    x = rows.view(torch.float8_e4m3fn).float() * 2.0**k
    codes, s = Q.fp8_quant_ref(x)
    assert torch.equal(codes, rows) and (s == 127 + k).all()
    assert_same(Q.fp8_fake_quant(x), x)


@given(k=st.integers(-120, 120), seed=seeds)
@fast
def test_every_e2m1_value_round_trips_mxfp4(k, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.arange(16), torch.randint(0, 16, (16,), generator=g)]).to(torch.uint8)
    codes = codes[torch.randperm(32, generator=g)]
    x = Q.unpack_e2m1(Q.pack_e2m1(codes)).to(torch.int64)
    x = torch.where(x >= 8, -E2M1[x & 7], E2M1[x & 7]) * 2.0**k
    packed, s = Q.mxfp4_quant_ref(x)
    assert torch.equal(Q.unpack_e2m1(packed), codes) and s.item() == 127 + k
    assert_same(Q.fp4_ue8m0_fake_quant(x), x)


def test_every_e2m1_value_round_trips_under_every_e4m3_scale():
    scale_bytes = torch.arange(1, 0x7F, dtype=torch.uint8)  # every positive finite e4m3 scale
    s = scale_bytes.view(torch.float8_e4m3fn).float()[:, None]
    vals = torch.cat([E2M1, -E2M1])  # contains +-6, so amax = 6 s and the scale is s itself
    x = vals[None, :] * s
    packed, sb = Q.fp4_e4m3_quant_ref(x)
    assert torch.equal(sb[:, 0], scale_bytes)
    assert torch.equal(Q.unpack_e2m1(packed), torch.cat([torch.arange(8), torch.arange(8) | 8]).to(torch.uint8).expand(126, 16))
    assert_same(Q.fp4_e4m3_fake_quant(x), x)


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@given(seed=seeds)
@fast
def test_error_bound_half_step(name, fq, block, quant, dequant, seed):
    x = rand(seed, 8, 128, block=block, spread=8 if name == "fp4_e4m3" else 30)  # e4m3 scale: amax < 6*448
    y = fq(x).double()
    s = scales_of(name, quant(x)[1]).repeat_interleave(block, -1)
    v = (x.double() / s)
    if name == "fp8":
        m = v.abs().clamp(max=448)
        step = torch.exp2(torch.floor(torch.log2(m.clamp(min=2.0**-6))) - 3)
    else:
        m = v.abs().clamp(max=6)
        step = torch.where(m < 2, 0.5, torch.where(m < 4, 1.0, 2.0))
    err = (y / s - v.clamp(-448 if name == "fp8" else -6, 448 if name == "fp8" else 6)).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()  # 1e-6: x/s is an fp32 division for e4m3 scales
    if name == "fp4_e4m3":  # a normal e4m3 scale is at most 1/16 below amax/6
        assert (v.abs()[s >= 2.0**-6] <= 6.4).all()


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@given(seed=seeds)
@fast
def test_monotone_within_a_block(name, fq, block, quant, dequant, seed):
    x = rand(seed, 64, block=64, spread=30).sort().values
    y = fq(x[None], block=64)[0]
    assert (y[1:] >= y[:-1]).all()


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@given(seed=seeds)
@fast
def test_dequant_of_quant_equals_fake_quant(name, fq, block, quant, dequant, seed):
    x = rand(seed, 3, 4, 128, block=block, spread=40)
    x[0, 1] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        codes, s = quant(xd)
        assert codes.dtype == torch.uint8 and s.dtype == torch.uint8
        assert_same(dequant(codes, s, dtype), fq(xd))


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@given(xs=st.lists(st.floats(-(2.0**127), 2.0**127, width=32), min_size=32, max_size=32))
@settings(max_examples=60, deadline=None)
def test_dequant_of_quant_equals_fake_quant_any_floats(name, fq, block, quant, dequant, xs):
    x = torch.tensor(xs, dtype=torch.float32)[None]
    assert_same(dequant(*quant(x)), fq(x))
    assert torch.isfinite(fq(x)).all()


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@given(seed=seeds)
@fast
def test_bf16_input_is_exact_function_of_fp32(name, fq, block, quant, dequant, seed):
    x = rand(seed, 6, 128, block=block, spread=50, dtype=torch.bfloat16)
    y32 = fq(x.float())
    assert_same(y32.bfloat16().float(), y32)  # q*s is exact in bf16
    assert_same(fq(x), y32.bfloat16())


@pytest.mark.parametrize("name,fq,block,quant,dequant", FAKES, ids=IDS)
@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_non_finite_block_becomes_nan(name, fq, block, quant, dequant, bad):
    x = rand(7, 2, 64, block=block)
    clean = fq(x)
    x[1, block + 3] = bad
    y = fq(x)
    blk = slice(block, 2 * block)
    assert torch.isnan(y[1, blk]).all()
    keep = torch.ones_like(y, dtype=torch.bool)
    keep[1, blk] = False
    assert torch.equal(y[keep], clean[keep])
    codes, s = quant(x)
    assert s[1, 1].item() == (0x7F if name == "fp4_e4m3" else 0xFF)
    assert_same(dequant(codes, s), y)


@pytest.mark.parametrize("fq,block", [(Q.fp8_fake_quant, 32), (Q.fp4_ue8m0_fake_quant, 32), (Q.fp4_e4m3_fake_quant, 16)])
def test_bad_block_raises(fq, block):
    with pytest.raises(ValueError):
        fq(torch.zeros(3, block + 8))
    with pytest.raises(ValueError):
        fq(torch.tensor(1.0))


def test_packed_row_bytes_and_codec_sizes():
    assert Q.packed_row_bytes("fp8", 512) == 528
    assert Q.packed_row_bytes("fp4_e4m3", 512) == 288
    assert Q.packed_row_bytes("mxfp4", 128) == 68
    for fmt, n, quant in (("fp8", 512, Q.fp8_quant_ref), ("fp4_e4m3", 512, Q.fp4_e4m3_quant_ref),
                          ("mxfp4", 128, Q.mxfp4_quant_ref)):
        codes, s = quant(torch.randn(5, n))
        assert codes.shape[:-1] == s.shape[:-1] == (5,)
        assert codes.shape[-1] + s.shape[-1] == Q.packed_row_bytes(fmt, n)
    for bad in (("fp8", 48), ("nvfp4", 64), ("mxfp4", 0)):
        with pytest.raises(ValueError):
            Q.packed_row_bytes(*bad)


# ----------------------------------------------------------------------------------- weights

@given(out=st.integers(1, 80), inn=st.integers(1, 80), seed=seeds)
@fast
def test_fp8_weight_round_trip(out, inn, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g) * torch.exp2(torch.randint(-8, 8, (out, 1), generator=g).float())
    q, s = Q.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (out, inn)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (math.ceil(out / 32), math.ceil(inn / 32))
    d = Q.dequant_fp8_weight(q, s)
    assert d.dtype == torch.float32
    for i in range(0, out, 32):
        for j in range(0, inn, 32):
            tile = w[i:i + 32, j:j + 32]
            want = Q.fp8_fake_quant(tile.reshape(1, -1), block=tile.numel()).reshape(tile.shape)
            assert_same(d[i:i + 32, j:j + 32], want)
    assert_same(Q.dequant_fp8_weight(*Q.quantize_fp8_weight(d)), d)  # dequantised weights are representable


def test_fp8_weight_extreme_scale_bytes():
    q = torch.ones(40, 40).to(torch.float8_e4m3fn)
    s = torch.tensor([[0, 254], [127, 255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = Q.dequant_fp8_weight(q, s)
    assert d[0, 0] == 2.0**-127 and d[0, 39] == 2.0**127 and d[39, 0] == 1.0 and torch.isnan(d[39, 39])
    with pytest.raises(ValueError):
        Q.dequant_fp8_weight(q, s[:1])


@given(seed=seeds, out=st.integers(1, 40), nb=st.integers(1, 4))
@fast
def test_fp4_weight_round_trip(seed, out, nb):
    w = rand(seed, out, 32 * nb, block=32, spread=20)
    packed, s = Q.quantize_fp4_weight(w)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (out, 16 * nb)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (out, nb)
    d = Q.dequant_fp4_weight(packed, s)
    assert_same(d, Q.fp4_ue8m0_fake_quant(w))
    assert_same(Q.dequant_fp4_weight(packed.view(torch.uint8), s), d)
    with pytest.raises(ValueError):
        Q.quantize_fp4_weight(torch.randn(4, 48))


@given(seed=seeds)
@fast
def test_fp8_rows_engram_format(seed):
    w = rand(seed, 3, 7, 64, block=32, spread=20)
    v, s = Q.quantize_fp8_rows(w)
    assert v.dtype == torch.float8_e4m3fn and v.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 7, 2)
    assert_same(Q.dequant_fp8_rows(v, s), Q.fp8_fake_quant(w))
    assert_same(Q.dequant_fp8_rows(v, s), Q.fp8_dequant_ref(v.view(torch.uint8), s.view(torch.uint8)))


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e4m3", "mxfp4"])
def test_empty_rows_round_trip(fmt):
    quantise, dequantise = {"fp8": (Q.fp8_quant_ref, Q.fp8_dequant_ref),
                            "fp4_e4m3": (Q.fp4_e4m3_quant_ref, Q.fp4_e4m3_dequant_ref),
                            "mxfp4": (Q.mxfp4_quant_ref, Q.mxfp4_dequant_ref)}[fmt]
    codes, scales = quantise(torch.zeros(0, 512))
    assert codes.shape[0] == 0 and scales.shape[0] == 0
    assert dequantise(codes, scales).shape == (0, 512)
