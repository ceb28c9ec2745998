"""The cache module: packed storage is exact, and its allocation equals the kv-budget formula."""
from pathlib import Path

import pytest
import torch

import dsv41c
from dsv41c import quant
from dsv41c.cache import ModelCache, RowStore
from dsv41c.config import ModelArgs, build_layer_plan
from dsv41c.kv_budget import kv_budget

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["tiny.json", "flash.json"])
def test_packed_allocation_equals_the_formula(name):
    args = ModelArgs.from_json(CONFIGS / name)
    with torch.device("meta"):                      # flash at 1M tokens: nothing is allocated
        cache = ModelCache(args, build_layer_plan(args), torch.bfloat16, "packed")
    got = cache.nbytes()
    budget = kv_budget(args, context=args.max_seq_len).packed
    b = args.max_batch_size
    assert got["global"] == b * budget.global_bytes
    assert got["window"] == b * budget.window_bytes
    assert got["groups"] == b * budget.partial_group_bytes
    if name == "flash.json":
        assert got["global"] == 890 * 2**20                     # 890 B/token at 2^20 tokens


def test_plain_bf16_allocation_equals_the_bf16_formula():
    args = ModelArgs.from_json(CONFIGS / "tiny.json")
    cache = ModelCache(args, build_layer_plan(args), torch.bfloat16, "plain")
    budget = kv_budget(args, context=args.max_seq_len).bf16
    assert cache.nbytes()["global"] == args.max_batch_size * budget.global_bytes
    assert cache.nbytes()["window"] == args.max_batch_size * budget.window_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_storage_gives_identical_logits(dtype):
    args = ModelArgs.from_json(CONFIGS / "tiny.json")
    ids = torch.randint(0, 259, (2, 45))
    plain = dsv41c.build_model(args, seed=0, dtype=dtype, kv_quant=True)
    packed = dsv41c.build_model(args, seed=0, dtype=dtype, kv_quant=True, kv_storage="packed")
    assert packed.cache.layers[1].kv.codes.dtype == torch.uint8
    with torch.no_grad():
        assert torch.equal(plain(ids[:, :33], 0, full_logits=True), packed(ids[:, :33], 0, full_logits=True))
        for p in range(33, 45):     # odd prefill: the first decode completes a ratio-2 group
            assert torch.equal(plain(ids[:, p:p + 1], p), packed(ids[:, p:p + 1], p))


def test_packed_storage_needs_kv_quant():
    args = ModelArgs.from_json(CONFIGS / "tiny.json")
    with pytest.raises(dsv41c.InputError, match="kv_quant"):
        dsv41c.build_model(args, kv_quant=False, kv_storage="packed")


def test_packed_rows_read_back_as_the_fake_quant_of_what_was_written():
    """A packed FP4 store decodes to fake_quant(x) of the x written to it. Writing fake_quant(x)
    instead quantises twice, which for FP4 with E4M3 scales is not the identity (blocks whose scale
    is an E4M3 subnormal), so the attention hands a packed cache the un-quantised entries."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, 512, generator=g)
    x = x * torch.exp2(torch.randint(-10, 2, (1, 256, 32, 1), generator=g).float()).repeat_interleave(16, -2)[..., 0]
    store = RowStore(1, 256, 512, torch.float32, "fp4_e4m3")
    store.write(slice(0, 256), x)
    assert torch.equal(store.read(1), quant.fp4_e4m3_fake_quant(x, 16))
    store.write(slice(0, 256), quant.fp4_e4m3_fake_quant(x, 16))
    assert not torch.equal(store.read(1), quant.fp4_e4m3_fake_quant(x, 16))
