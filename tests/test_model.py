"""Whole-model properties of the eager reference on the tiny config."""
from pathlib import Path

import pytest
import torch

import dsv41c
from dsv41c import InputError, ModelArgs

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"
S = 100   # > window (16); ratio-2 and ratio-1 top-k and the candidate funnel all select


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def args():
    return ModelArgs.from_json(TINY)


@pytest.fixture(scope="module")
def model(args):
    return dsv41c.build_model(args, seed=0, dtype=torch.float32, kv_quant=False)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 259, (2, S), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def full(model, ids):
    with torch.no_grad():
        return model(ids, start_pos=0, full_logits=True)


def prefill_then_decode(model, ids, k):
    with torch.no_grad():
        out = [model(ids[:, :k], start_pos=0, full_logits=True)]
        for p in range(k, ids.shape[1]):
            out.append(model(ids[:, p:p + 1], start_pos=p).unsqueeze(1))
    return torch.cat(out, dim=1)


def test_shapes_and_dtypes(model, ids, full):
    assert full.shape == (2, S, 259) and full.dtype == torch.float32
    with torch.no_grad():
        last = model(ids, start_pos=0)
    assert last.shape == (2, 259)
    assert rel_err(last, full[:, -1]) < 1e-6


# Ties in the indexer's top-k are broken by torch.topk, and the reference itself resolves them
# differently when the score width differs (spec §6.5); with 8 index heads exact zero-score ties
# are rare, and these fixed seeds have none at a selection boundary.
@pytest.mark.parametrize("k", [1, 2, 17, 37, 64])
def test_prefill_equals_prefill_plus_decode(model, ids, full, k):
    stepped = prefill_then_decode(model, ids, k)
    assert rel_err(stepped, full) < 1e-5


def test_decode_to_the_last_position_of_an_odd_max_seq_len(args, ids):
    """Decode writes the open ratio-2 group's provisional entry at row t // 2 at every step; at
    t = max_seq_len - 1 with an odd max_seq_len that row exists only in the ceil-sized cache. The
    decoded logits still equal the prefill's, the last position included."""
    n = 61
    odd = dsv41c.build_model(args.replace(max_seq_len=n), seed=0, dtype=torch.float32)
    assert odd.cache.layers[1].kv.rows * 2 > n
    with torch.no_grad():
        full = odd(ids[:, :n], start_pos=0, full_logits=True)
        odd.reset_cache()
        stepped = prefill_then_decode(odd, ids[:, :n], 40)
    assert rel_err(stepped, full) < 1e-5


def test_prefill_plus_decode_with_kv_quant(args, ids):
    """With the fake quantisers on, a 1-ulp GEMM difference can flip a rounding step and, through
    the top-k, the selection: no tolerance bound holds, but the argmax must nearly always agree."""
    model = dsv41c.build_model(args, seed=0, dtype=torch.float32, kv_quant=True)
    with torch.no_grad():
        full = model(ids, start_pos=0, full_logits=True)
    stepped = prefill_then_decode(model, ids, 33)
    agree = (stepped.argmax(-1) == full.argmax(-1)).float().mean().item()
    print(f"kv_quant prefill vs decode: top-1 agreement {agree:.3f}, rel err {rel_err(stepped, full):.2e}")
    assert agree > 0.9


def test_new_sequence_after_reset_matches(model, ids, full):
    with torch.no_grad():
        model(ids[:, :10].flip(0), start_pos=0)
        again = model(ids, start_pos=0, full_logits=True)
    assert torch.equal(again, full)


def test_bf16_twin_within_bound(args, ids):
    """DESIGN.md: any bf16 path vs its fp32 twin within 2e-2. Compared on 8 tokens, where the
    indexer's top-k and funnel select nothing yet and no expert choice of the MoE flips: a discrete
    selection flipped by bf16 rounding (exact ties are common in bf16 scores) is not a numerics
    error, and neither is an FP4 rounding step flipped by kv_quant, so both are kept out of this
    bound. (At bench.json's widths one flipped expert choice moves the logits 0.061, the rest 0.0075:
    BENCHMARKS.md, eager model.)"""
    f32 = dsv41c.build_model(args, seed=0, dtype=torch.float32, kv_quant=False)
    b16 = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=False)
    short = ids[:, :8]
    with torch.no_grad():
        a, b = b16(short, 0, full_logits=True), f32(short, 0, full_logits=True)
    assert a.dtype == torch.float32
    assert rel_err(a, b) < 2e-2


def test_kv_quant_changes_logits(args, ids, full):
    quantised = dsv41c.build_model(args, seed=0, dtype=torch.float32, kv_quant=True)
    with torch.no_grad():
        q = quantised(ids, 0, full_logits=True)
    assert torch.isfinite(q).all() and rel_err(q, full) > 1e-3


def test_batch_rows_are_independent(model, ids, full):
    with torch.no_grad():
        one = model(ids[1:], start_pos=0, full_logits=True)
    assert rel_err(one[0], full[1]) < 1e-5


def test_dspark_draft_protocol(args, ids):
    model = dsv41c.build_model(args, seed=0)
    with torch.no_grad():
        logits, hidden = model(ids[:, :20], 0, return_hidden=True)
        assert hidden.shape == (2, 20, args.dim * len(args.dspark_target_layer_ids))
        assert model.draft(logits.argmax(-1), hidden, 0) is None
        token = logits.argmax(-1)
        for p in range(20, 23):
            logits, hidden = model(token.view(2, 1), p, return_hidden=True)
            token = logits.argmax(-1)
            out, dl, conf = model.draft(token, hidden, p)
    beta = args.dspark_block_size
    assert out.shape == (2, beta + 1) and dl.shape == (2, beta, 259) and conf.shape == (2, beta)
    assert torch.equal(out[:, 0], token)
    assert torch.equal(out[:, 1:], dl.argmax(-1))     # temperature 0: greedy over the Markov-biased logits
    assert torch.isfinite(dl).all() and torch.isfinite(conf).all()


@pytest.mark.parametrize("make, start, match", [
    (lambda: torch.full((1, 4), 259), 0, "outside the vocabulary"),
    (lambda: torch.full((1, 4), -1), 0, "outside the vocabulary"),
    (lambda: torch.zeros(1, 300, dtype=torch.long), 0, "max_seq_len"),
    (lambda: torch.zeros(3, 4, dtype=torch.long), 0, "max_batch_size"),
    (lambda: torch.zeros(1, 4, dtype=torch.long), 5, "one-token decode"),
    (lambda: torch.zeros(4, dtype=torch.long), 0, r"\[B, S\]"),
    (lambda: torch.zeros(1, 4), 0, "int64"),
])
def test_bad_inputs(model, make, start, match):
    with pytest.raises(InputError, match=match):
        model(make(), start_pos=start)
