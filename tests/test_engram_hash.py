from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from dsv41c.engram_hash import (
    DEAD, EngramLayout, compressed_token_map, engram_hash_ids, engram_multiplier_bound,
    engram_multipliers, engram_offsets, engram_primes, is_prime,
)
from dsv41c.errors import ConfigError
from dsv41c.tokenizer import Tokenizer, gpt2_byte_to_unicode


def tiny_args(**kw):
    args = dict(engram_layer_ids=(0, 3), engram_num_embeddings=(1000, 1200), engram_max_ngram_size=3,
                engram_vocab_size=100, engram_n_heads=2, engram_head_dim=32, engram_pad_id=258,
                engram_compressed_vocab_size=230)
    args.update(kw)
    return SimpleNamespace(**args)


def released_args(**kw):
    args = dict(engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682],
                engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8,
                engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=99092)
    args.update(kw)
    return SimpleNamespace(**args)


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.byte_level()


@pytest.fixture(scope="module")
def tiny_layout(byte_tok):
    return EngramLayout(tiny_args(), byte_tok)


def test_is_prime_matches_sieve():
    n = 5000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for i in range(2, n):
        if sieve[i]:
            for j in range(i * i, n, i):
                sieve[j] = False
    assert [is_prime(i) for i in range(n)] == sieve
    assert is_prime(16000057) and not is_prime(16000057 * 3) and not is_prime(4001 * 3989)


def test_tiny_layout_numbers():
    primes = engram_primes(tiny_args())
    assert primes == [[[101, 103], [107, 109]], [[113, 127], [131, 137]]]
    assert [engram_offsets(p) for p in primes] == [[0, 101, 204, 311], [0, 113, 240, 371]]
    assert engram_multipliers(tiny_args()) == [
        [25543193979950161, 10818883615846199, 1643104586628253],
        [11859578741866783, 35181641445438771, 4686591120135479]]


def test_released_layout_numbers():
    args = released_args()
    primes = engram_primes(args)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081]
    assert [sum(map(sum, layer)) for layer in primes] == [384006168, 384016682]
    flat = [p for layer in primes for heads in layer for p in heads]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert engram_multiplier_bound(99092) == 46539438283891
    assert engram_multipliers(args)[0] == [76632096046245, 4839876093313, 35959672319349, 73987337458391]


def test_layout_tensors(tiny_layout):
    lay = tiny_layout
    assert lay.primes.tolist() == [[101, 103, 107, 109], [113, 127, 131, 137]]
    assert lay.offsets.tolist() == [[0, 101, 204, 311], [0, 113, 240, 371]]
    assert lay.multipliers.shape == (2, 3) and lay.multipliers.dtype == torch.int64
    assert lay.token_map.shape == (259,) and lay.n_cols == 4
    assert lay.pad == int(lay.token_map[258])
    assert lay.to("cpu") is lay


def test_byte_level_has_230_classes(byte_tok):
    token_map, v_c = compressed_token_map(byte_tok)
    assert v_c == 230 and token_map.shape == (259,)
    assert token_map.unique().numel() == 230 and token_map.max().item() == 229
    m = token_map.tolist()
    assert all(m[ord(c)] == m[ord(c.lower())] for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert m[9] == m[10] == m[13] == m[32]
    assert len({m[b] for b in range(128, 256)}) == 128
    assert m[11] != m[32] and m[12] != m[32]
    assert m[:3] == [0, 1, 2]  # first-appearance order
    assert compressed_token_map(byte_tok.backend)[1] == 230


def test_normalisation_examples():
    char = gpt2_byte_to_unicode()
    to_sym = lambda s: "".join(char[b] for b in s.encode("utf-8"))  # noqa: E731
    words = ["The", " the", "THE", "the ", " ", "  ", "\t\n", " \r\n ", "\n\n", "café", "CAFE",
             "cafe", "ﬁ", "fi", "Ångström", "angstrom"]
    vocab = {char[b]: b for b in range(256)}
    for w in words:
        vocab.setdefault(to_sym(w), len(vocab))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    token_map, _ = compressed_token_map(backend)
    cls = {w: int(token_map[vocab[to_sym(w)]]) for w in words}
    assert cls["The"] == cls[" the"] == cls["THE"] == cls["the "]
    assert cls[" "] == cls["  "] == cls["\t\n"] == cls[" \r\n "] == cls["\n\n"] == int(token_map[32])
    assert cls["café"] == cls["CAFE"] == cls["cafe"]
    assert cls["ﬁ"] == cls["fi"]
    assert cls["Ångström"] == cls["angstrom"]
    assert cls["The"] != cls[" "] != cls["fi"]


def test_layout_validation(byte_tok):
    token_map, v_c = compressed_token_map(byte_tok)
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramLayout(tiny_args(engram_num_embeddings=(1000, 507)), (token_map, v_c))
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramLayout(tiny_args(engram_num_embeddings=(1000,)), (token_map, v_c))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        EngramLayout(tiny_args(engram_compressed_vocab_size=231), byte_tok)
    with pytest.raises(ConfigError, match="engram_pad_id"):
        EngramLayout(tiny_args(engram_pad_id=259), (token_map, v_c))
    lay = EngramLayout(tiny_args(engram_num_embeddings=(420, 508)), (token_map, v_c))
    assert lay.pad == int(token_map[258])


def reference_hashes(layout, comp, pad):
    """Plain-Python §8.4 over one sequence of compressed ids (DEAD allowed)."""
    n_max, n_heads = layout.max_ngram_size, layout.n_heads
    primes, offsets, mults = layout.primes.tolist(), layout.offsets.tolist(), layout.multipliers.tolist()
    out = []
    for t in range(len(comp)):
        toks, blocked = [], False
        for s in range(n_max):
            blocked = blocked or t - s < 0 or comp[t - s] < 0
            toks.append(pad if blocked else comp[t - s])
        per_layer = []
        for li, mu in enumerate(mults):
            x, row = toks[0] * mu[0], []
            for n in range(1, n_max):
                x ^= toks[n] * mu[n]
                assert 0 <= x < 2**63
                for h in range(n_heads):
                    c = (n - 1) * n_heads + h
                    row.append(x % primes[li][c] + offsets[li][c])
            per_layer.append(row)
        out.append(per_layer)
    return out


def released_like_layout(gen):
    """Released constants with a synthetic token map covering all 99092 classes, so that
    tok·μ gets close to 2^63."""
    v, v_c = 129280, 99092
    token_map = torch.cat([torch.arange(v_c), torch.randint(0, v_c, (v - v_c,), generator=gen)])
    token_map = token_map[torch.randperm(v, generator=gen)]
    return EngramLayout(released_args(), (token_map, v_c))


@pytest.fixture(scope="module", params=["tiny", "released_like"])
def layout(request, tiny_layout):
    if request.param == "tiny":
        return tiny_layout
    return released_like_layout(torch.Generator().manual_seed(0))


def expected(layout, ids, dead=None):
    comp = []
    for b in range(ids.shape[0]):
        row = [int(layout.token_map[i]) if 0 <= i < layout.token_map.numel() else DEAD for i in ids[b].tolist()]
        if dead is not None:
            row = [DEAD if d else c for c, d in zip(row, dead[b].tolist())]
        comp.append(reference_hashes(layout, row, layout.pad))
    return torch.tensor(comp, dtype=torch.int64)


def test_prefill_matches_reference(layout):
    gen = torch.Generator().manual_seed(1)
    v = layout.token_map.numel()
    ids = torch.randint(0, v, (2, 13), generator=gen)
    ids[1, 5] = ids[0, 2] = int(torch.nonzero(layout.token_map == layout.pad)[0])
    history = torch.randint(-5, 50, (2, 32), generator=gen)
    out = engram_hash_ids(layout, ids, 0, history)
    assert out.shape == (2, 13, len(layout.layer_ids), layout.n_cols) and out.dtype == torch.int64
    assert torch.equal(out, expected(layout, ids))
    assert torch.equal(history[:, :13], layout.token_map[ids])
    assert (out >= layout.offsets).all() and (out < layout.offsets + layout.primes).all()


def test_prefill_then_decode_matches_full_prefill(layout):
    gen = torch.Generator().manual_seed(2)
    v = layout.token_map.numel()
    ids = torch.randint(0, v, (3, 12), generator=gen)
    full = engram_hash_ids(layout, ids, 0, layout.new_history(3, 16))
    assert torch.equal(full, expected(layout, ids))
    for first in (1, 2, 5):
        history = torch.randint(0, 7, (3, 16), generator=gen)
        parts = [engram_hash_ids(layout, ids[:, :first], 0, history)]
        for t in range(first, 12):
            if t >= 4:  # rows older than the n-gram window must not be read
                history[:, : t - layout.max_ngram_size + 1] = torch.randint(-3, 9, (3, t - layout.max_ngram_size + 1),
                                                                            generator=gen)
            parts.append(engram_hash_ids(layout, ids[:, t:t + 1], t, history))
        assert torch.equal(torch.cat(parts, dim=1), full)
    history = layout.new_history(3, 16)
    chunks = [engram_hash_ids(layout, ids[:, :7], 0, history), engram_hash_ids(layout, ids[:, 7:], 7, history)]
    assert torch.equal(torch.cat(chunks, dim=1), full)


def test_dead_positions_block_history(tiny_layout):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 259, (2, 10), generator=gen)
    dead = torch.zeros(2, 10, dtype=torch.bool)
    dead[0, 3] = dead[0, 4] = dead[1, 0] = dead[1, 9] = True
    history = tiny_layout.new_history(2, 10)
    out = engram_hash_ids(tiny_layout, ids, 0, history, dead=dead)
    assert torch.equal(out, expected(tiny_layout, ids, dead))
    assert history[0, 3] == DEAD and history[1, 9] == DEAD
    pad_only = expected(tiny_layout, ids[:1, :1] * 0 + 258)[0, 0]
    assert torch.equal(out[0, 4], pad_only)
    ids[0, 6] = 100000  # an id outside the token map is DEAD as well
    out = engram_hash_ids(tiny_layout, ids, 0, tiny_layout.new_history(2, 10))
    assert torch.equal(out[0, 6], pad_only) and torch.equal(out, expected(tiny_layout, ids))


def test_fullgraph_compile(tiny_layout):
    step = torch.compile(lambda ids, pos, hist: engram_hash_ids(tiny_layout, ids, pos, hist),
                         fullgraph=True, backend="eager")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 259, (2, 9), generator=gen)
    history = tiny_layout.new_history(2, 16)
    parts = [step(ids[:, :5], 0, history)]
    parts += [step(ids[:, t:t + 1], t, history) for t in range(5, 9)]
    assert torch.equal(torch.cat(parts, dim=1), expected(tiny_layout, ids))
