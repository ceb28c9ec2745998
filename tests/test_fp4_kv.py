"""fp4_kv on the whole model (passes_only backend: the rewritten post-grad graph runs as is, the
codec kernels through their TileLang C builds): every cache write and read becomes a kernel call,
the caches allocate the packed formats, and the logits follow eager kv_quant. On a small module:
the bytes and read-back values, and the strict-mode failure on a codec site left as torch ops."""
from collections import Counter

import pytest
import torch
from conftest import THREE_KINDS, record_tiny_cut
from torch import nn

import dsv41c
from dsv41c import golden, quant
from dsv41c.cache import RowStore
from dsv41c.config import build_layer_plan
from dsv41c.kv_budget import kv_budget
from dsv41c.passes.fp4_kv import PackedKV
from dsv41c.passes.manager import PassError, PassPipeline
from dsv41c.weights import build_model

KERNELS = tuple(f"{fmt}_{way}" for fmt in ("fp8", "fp4_e4m3", "mxfp4") for way in ("quant", "dequant"))
STEPS = 6


def expected(kinds: list[str], prefill: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(cache writes and reads, kernel calls) of one forward call of a ratio-1 cut with one Full
    layer (the kv source, owning the index keys) followed by Reindex and Reuse layers.

    Every layer writes its window row(s) (fp8); a decode step reads the ring back, a prefill attends
    over its new rows directly. The Full layer writes compressed entries (fp4_e4m3) and index keys
    (mxfp4) in the prefill and, at ratio 1, in every decode step. Every compressed layer reads the
    Full layer's entries and the index sources (Full, Reindex) its index keys: the same rows, so
    one dequantise call serves each cache."""
    assert kinds[0] == "full" and set(kinds[1:]) <= {"reindex", "reuse"}
    n = len(kinds)
    io = {"fp8_quant": n, "fp8_dequant": 0 if prefill else n,
          "fp4_e4m3_quant": 1, "fp4_e4m3_dequant": n,
          "mxfp4_quant": 1, "mxfp4_dequant": 1 + kinds.count("reindex")}
    return io, dict(io, fp4_e4m3_dequant=1, mxfp4_dequant=1)


@torch.no_grad()
def teacher_forced(runner, g: golden.Golden) -> torch.Tensor:
    """Logits [B, S+N, V] of the prefill and of each decode step fed the golden file's tokens (as
    contiguous columns: a strided [B, 1] slice would compile a second decode graph)."""
    runner.reset_cache()
    prefill = runner(g.inputs, 0, full_logits=True)
    steps = [runner(g.decode_tokens[:, i:i + 1].contiguous(), g.prompt_len + i) for i in range(STEPS)]
    return torch.cat([prefill, torch.stack(steps, dim=1)], dim=1)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The 3-layer cut (Full, Reindex, Reuse at ratio 1; candidate blocks of 1 entry, so that every
    decode position compiles to one graph), fp32 with kv_quant, compiled with fp4_kv (strict); an
    eager twin with plain caches; the golden file's prompts (recorded without kv_quant) run greedily
    through both, then teacher-forced with the golden tokens."""
    path = record_tiny_cut(tmp_path_factory.mktemp("fp4kv"), "fp4kv", STEPS, **THREE_KINDS, hc_sinkhorn_iters=1,
                           candidate_block_size=1, engram_layer_ids=[], engram_num_embeddings=[])
    g = golden.load_golden(path)
    torch._dynamo.reset()
    model = build_model(g.args, seed=g.seed, dtype=torch.float32, kv_quant=True)
    compiled = dsv41c.compile(model, passes=("fp4_kv",), strict=True, backend="passes_only", keep_code=True)
    eager = build_model(g.args, seed=g.seed, dtype=torch.float32, kv_quant=True)
    eager_trace, eager_tokens = golden.run_greedy(eager, g.inputs, STEPS)
    trace, tokens = golden.run_greedy(compiled, g.inputs, STEPS)
    caches = {"eager": eager.cache.layers[0], "compiled": model.cache.layers[0]}
    caches = {k: {name: {n: t.clone() for n, t in getattr(c, name).named_buffers()} for name in ("window", "kv")}
              for k, c in caches.items()}
    forced = {"compiled": teacher_forced(compiled, g), "eager": teacher_forced(eager, g)}
    return dict(golden=g, model=model, compiled=compiled, eager_trace=eager_trace, eager_tokens=eager_tokens,
                trace=trace, tokens=tokens, caches=caches, forced=forced)


def test_every_cache_write_and_read_is_a_kernel_call(packed):
    model, compiled = packed["model"], packed["compiled"]
    assert compiled.graphs == 2                                       # prefill, decode step
    kinds = [role.kind for role in build_layer_plan(model.args)]
    total = Counter()
    for graph, prefill in ((1, True), (2, False)):
        snaps = {s.stage: s for s in compiled.snapshots if s.graph == graph}
        before, after = snaps["input"], snaps["fp4_kv"]
        io, want = expected(kinds, prefill)
        calls = {k: after.code.count(f"torch.ops.dsv41c.{k}.default(") for k in KERNELS}
        assert calls == want, (graph, calls)
        assert not any(f"torch.ops.dsv41c.{k}" in before.code for k in KERNELS)
        assert after.counts.cache_writes == before.counts.cache_writes               # same buffers, now packed
        if not prefill:
            # every fake quantiser of a cached vector fed only the cache write; reading its input
            # instead left it dead, so no E4M3 conversion is left in a decode step
            assert "float8_e4m3fn" in before.code and "float8_e4m3fn" not in after.code
        total.update(io)
    assert compiled.pipeline.stats["fp4_kv"].matches == total.total()
    counts = compiled.pipeline.passes[0].inner.counts                 # (direction, format) over both graphs
    assert {f"{fmt}_{'quant' if way == 'write' else 'dequant'}": c for (way, fmt), c in counts.items()} == total


def test_allocated_bytes_equal_the_kv_budget(packed):
    model = packed["model"]
    args, b = model.args, model.args.max_batch_size
    budget = kv_budget(args, context=args.max_seq_len)
    stores = [s for layer in model.cache.layers for s in (layer.window, layer.kv, layer.index_keys) if s is not None]
    assert model.cache.storage == "packed"
    assert all(buf.dtype == torch.uint8 for s in stores for buf in s.buffers())
    got = model.cache.nbytes()
    d, d_i = args.head_dim, args.index_head_dim      # spec §10.5: E2M1 pairs + one scale byte per block
    entry = {"kv": d // 2 + d // 16, "index_key": d_i // 2 + d_i // 32, "window": d + d // 32}
    assert got["global"] == b * budget.packed.global_bytes == b * args.max_seq_len * (entry["kv"] + entry["index_key"])
    assert got["window"] == b * budget.packed.window_bytes == b * args.n_layers * args.window_size * entry["window"]
    plain = build_model(args, seed=None, dtype=torch.bfloat16, kv_quant=True).cache.nbytes()
    assert plain["global"] == b * budget.bf16.global_bytes
    print(f"\nfp4_kv cache bytes: global {got['global']} (formula {b * budget.packed.global_bytes}), "
          f"window {got['window']}; bf16 plain global {plain['global']} "
          f"({plain['global'] / got['global']:.2f}x)")


def test_caches_hold_the_packed_bytes_of_the_plain_kv_quant_rows(packed):
    """The compiled model's layer-0 caches, dequantised by the refs, against the eager twin's plain
    caches (fake-quantised rows) after the same greedy run."""
    caches, g = packed["caches"], packed["golden"]
    n = g.prompt_len + STEPS
    window = quant.fp8_dequant_ref(caches["compiled"]["window"]["codes"], caches["compiled"]["window"]["scales"])
    kv = quant.fp4_e4m3_dequant_ref(caches["compiled"]["kv"]["codes"][:, :n], caches["compiled"]["kv"]["scales"][:, :n])
    plain_window, plain_kv = caches["eager"]["window"]["data"], caches["eager"]["kv"]["data"][:, :n]
    assert plain_kv.abs().amax(-1).gt(0).all() and caches["compiled"]["kv"]["codes"][:, n:].eq(0).all()
    for found, want in ((window, plain_window), (kv, plain_kv)):
        same = (found == want).float().mean().item()
        assert same > 0.99 and golden.relative_error(found, want) < 0.1, same


def test_compiled_fp4_kv_matches_eager_kv_quant(packed):
    trace, ref = packed["trace"], packed["eager_trace"]
    assert torch.equal(packed["tokens"], packed["eager_tokens"])                   # greedy tokens identical
    errors = [golden.relative_error(trace.prefill_logits, ref.prefill_logits)]
    errors += [golden.relative_error(trace.decode_logits[:, i], ref.decode_logits[:, i]) for i in range(STEPS)]
    print(f"\nfp4_kv compiled vs eager kv_quant: relative max-abs logit error {max(errors):.2e}")
    assert max(errors) <= 1e-3, errors


def test_compiled_fp4_kv_against_plain_eager(packed):
    """Against the unquantised eager model (the golden file), teacher-forced on its tokens. The KV
    quantisation moves the logits of the random tiny model a lot (the compressed KV keeps 3 bits
    of mantissa-and-exponent per value), so the top-1 choice often changes; the compiled model
    changes it exactly where eager kv_quant does."""
    g, forced = packed["golden"], packed["forced"]
    want = torch.cat([g.prefill_logits, g.decode_logits], dim=1)
    found = forced
    agree = {k: (v.argmax(-1) == want.argmax(-1)).float().mean().item() for k, v in found.items()}
    error = {k: golden.relative_error(v, want) for k, v in found.items()}
    print(f"\nfp4_kv compiled vs plain eager: top-1 agreement {agree['compiled']:.3f} over "
          f"{want.shape[0] * want.shape[1]} positions, relative max-abs logit error {error['compiled']:.3g} "
          f"(max abs {(found['compiled'] - want).abs().max():.3g}); eager kv_quant vs plain eager: "
          f"{agree['eager']:.3f}, {error['eager']:.3g}")
    assert torch.equal(found["compiled"].argmax(-1), found["eager"].argmax(-1))
    assert golden.relative_error(found["compiled"], found["eager"]) <= 1e-3
    assert 0.5 < agree["compiled"] < 1 and 0.1 < error["compiled"] < 2


# ------------------------------------------------------------------------------ small graphs
class Stores(nn.Module):
    """One packed store of each format, written with its fake-quantised rows and read back."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.window = RowStore(2, 8, 64, dtype, "fp8")
        self.kv = RowStore(2, 8, 64, dtype, "fp4_e4m3")
        self.keys = RowStore(2, 8, 32, dtype, "mxfp4")

    def forward(self, x, e, k):
        n = x.shape[1]
        self.window.write(slice(0, n), quant.fp8_fake_quant(x, 32))
        self.kv.write(slice(0, n), quant.fp4_e4m3_fake_quant(e, 16))
        self.keys.write(slice(0, n), quant.fp4_ue8m0_fake_quant(k, 32))
        return self.window.read(2, n), self.kv.read(2, n), self.keys.read(2, n)


def rows(dtype: torch.dtype = torch.float32):
    """Random rows. The first compressed-KV block of each sequence peaks at 9 * 2^-9: its E4M3
    scale is the subnormal 2^-8 (9/6 * 2^-9 rounds to even), the peak becomes 4 * 2^-8, and
    quantising that fake-quantised block again gives the scale 2^-9 and saturates the peak to
    6 * 2^-9: FP4 with E4M3 scales is not idempotent there."""
    e = torch.randn(2, 6, 64)
    e[:, 0, :16] = torch.rand(2, 16) * 0.02 - 0.01
    e[:, 0, 5] = 9 * 2.0**-9
    return torch.randn(2, 6, 64).to(dtype), e.to(dtype), torch.randn(2, 6, 32).to(dtype)


def compile_stores(module, passes, *inputs):
    from dsv41c.compiler import dynamo_backend, inductor_options
    torch._dynamo.reset()
    pipeline = PassPipeline(passes, strict=passes[0].strict)
    with torch.no_grad(), torch._inductor.config.patch({**inductor_options(pipeline), "fx_graph_cache": False}):
        fn = torch.compile(module, backend=dynamo_backend("passes_only"), fullgraph=True)
        return fn(*inputs), pipeline


def strict_pass(formats=("fp8", "fp4_e4m3", "mxfp4"), strict=True) -> PackedKV:
    p = PackedKV(formats=formats)
    p.strict = strict
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_stores_read_back_the_plain_fake_quantised_rows(dtype):
    x, e, k = rows(dtype)
    module = Stores(dtype).eval()
    (window, kv, keys), pipeline = compile_stores(module, [strict_pass()], x, e, k)
    assert pipeline.stats["fp4_kv"].matches == 6
    assert torch.equal(window, quant.fp8_fake_quant(x, 32))
    assert torch.equal(kv, quant.fp4_e4m3_fake_quant(e, 16))
    assert torch.equal(keys, quant.fp4_ue8m0_fake_quant(k, 32))
    twice = quant.fp4_e4m3_dequant_ref(*quant.fp4_e4m3_quant_ref(quant.fp4_e4m3_fake_quant(e, 16)))
    assert not torch.equal(twice, kv)                     # the re-quantised row would have moved
    codes, scales = quant.fp4_e4m3_quant_ref(e)           # the bytes stored are those of the input
    assert torch.equal(module.kv.codes[:, :6], codes) and torch.equal(module.kv.scales[:, :6], scales)
    assert module.window.codes[:, 6:].eq(0).all() and module.window.codes.dtype == torch.uint8


def test_a_codec_site_left_as_torch_ops_fails_in_strict_mode():
    with pytest.raises(Exception, match=r"left as torch ops, first: fp8 write at"):
        compile_stores(Stores().eval(), [strict_pass(("fp4_e4m3", "mxfp4"))], *rows())


def test_a_codec_site_left_as_torch_ops_is_reported_and_correct_otherwise():
    x, e, k = rows()
    with pytest.warns(UserWarning, match="2 cache codec site"):
        (window, kv, _), pipeline = compile_stores(Stores().eval(), [strict_pass(("fp4_e4m3", "mxfp4"), False)],
                                                   x, e, k)
    stats = pipeline.stats["fp4_kv"]
    assert stats.matches == 4 and sum(d.startswith("left: fp8") for d in stats.details) == 2
    assert torch.equal(kv, quant.fp4_e4m3_fake_quant(e, 16))
    assert torch.equal(window, quant.fp8_fake_quant(quant.fp8_fake_quant(x, 32), 32))


def test_binding_needs_kv_quant(tiny_model):
    with pytest.raises(PassError, match="kv_quant=True"):
        PackedKV().bind(tiny_model)
    assert tiny_model.cache.storage == "plain"
