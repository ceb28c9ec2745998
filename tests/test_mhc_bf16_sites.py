"""The mHC kernels against the eager model's own mHC sites, bf16 streams.

A bf16 tiny cut runs eager; every call of `dsv41c.mhc.hc_mixes / hc_collapse / hc_expand` is
recorded with its operands (model shapes [B, S, ...], in the order `Block.forward` makes them,
layer 0 reading the stride-0 expanded embedding and the one-hot pre). Each site is then replayed
through the kernel `lower_mhc` puts there, on the same operands flattened to [T, ...]:

  * h_new and x: bit-identical to the eager site (measured on small.json, D = 1024, T = 1..40:
    0 of ~10^7 stream elements differ). The expand / collapse use the eager fp32 operation order,
    and x and the mixes read h_new as stored (bf16-rounded).
  * pre/post/comb: only the GEMM's summation order differs (the C build sums the m*D products in
    sequence, torch's GEMM in blocks). Measured max |kernel - eager|: 5e-6 at D = 1024, 7e-7 at
    D = 64 (960 sites, 20 model seeds); MIX_ATOL is 4x the D = 64 figure and far below the ~1e-3
    that mixing from the unrounded fp32 h_new would give.
"""
import secrets

import pytest
import torch
from conftest import ROOT, THREE_KINDS
from dsv41c.tilelang_kernels import mhc as K

import dsv41c
from dsv41c import mhc

MIX_ATOL = 3e-6


def ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers in value order, so a difference counts ulps (+0 and -0 coincide)."""
    i = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def record_sites(model, monkeypatch, ids, start_pos):
    events = []

    def recorder(kind, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            events.append((kind, args, out))
            return out
        return wrapped

    with monkeypatch.context() as mp:
        for kind in ("hc_mixes", "hc_collapse", "hc_expand"):
            mp.setattr(mhc, kind, recorder(kind, getattr(mhc, kind)))
        with torch.no_grad():
            model(ids, start_pos)
    return events


def reader(events, k, kind, h):
    return next((e for e in events[k + 1:k + 3] if e[0] == kind and e[1][0] is h), None)


def replay(events, hc):
    """(site kind, kernel outputs, eager outputs) of each site, paired as lower_mhc pairs them."""
    def flat(t, tail):
        return t.reshape(-1, *t.shape[t.dim() - tail:])

    expanded = {id(out) for kind, _, out in events if kind == "hc_expand"}
    for k, (kind, args, out) in enumerate(events):
        if kind == "hc_expand":
            y, res, post, comb = args
            mixes, collapse = reader(events, k, "hc_mixes", out), reader(events, k, "hc_collapse", out)
            w = collapse[1][1] if collapse else post
            operands = (flat(y, 1), flat(res, 2), flat(post, 1), flat(comb, 2), flat(w, 1))
            if mixes:
                got = K.mhc_post_pre(*operands, *mixes[1][1:], **hc)
                yield "post_pre", got, (out, collapse[2], *mixes[2])
            else:
                got = K.mhc_post_collapse(*operands)
                yield "post_collapse", got[:1 + bool(collapse)], (out, *(collapse[2:] if collapse else ()))
        elif kind == "hc_mixes" and id(args[0]) not in expanded:
            collapse = reader(events, k, "hc_collapse", args[0])
            got = K.mhc_pre(flat(args[0], 2), *args[1:], flat(collapse[1][1], 1), **hc)
            yield "pre", got, (collapse[2], *out)


@pytest.fixture(scope="module")
def model():
    """tiny.json in bf16 cut to 3 layers, an Engram before layer 1: layer 0 reads the expanded
    embedding, layer 1 the Engram's output; the last layer's FFN site feeds the head."""
    args = dsv41c.ModelArgs.from_json(ROOT / "configs" / "tiny.json")
    args = args.replace(**THREE_KINDS, engram_layer_ids=[1], engram_num_embeddings=args.engram_num_embeddings[:1])
    seed = secrets.randbits(31)
    return dsv41c.build_model(args, seed=seed, dtype=torch.bfloat16), seed


@pytest.mark.parametrize("batch,length", [(2, 5), (1, 1)])
def test_kernels_reproduce_the_eager_bf16_sites(model, monkeypatch, batch, length):
    model, model_seed = model
    seed = secrets.randbits(31)
    g = torch.Generator().manual_seed(seed)
    model.reset_cache()
    ids = torch.randint(0, model.args.vocab_size, (batch, length), generator=g)
    steps = [record_sites(model, monkeypatch, ids, 0),
             record_sites(model, monkeypatch, ids[:, :1], length)]              # one decode step
    hc = model.layers[0].hc
    kinds = []
    for step, events in enumerate(steps):
        for kind, got, want in replay(events, hc):
            kinds.append(kind)
            what = f"{kind} site {len(kinds)} (step {step}, model seed {model_seed}, ids seed {seed})"
            assert len(got) == len(want), what
            n_streams = len(got) - (3 if kind != "post_collapse" else 0)
            for i, (g_, w) in enumerate(zip(got[:n_streams], want[:n_streams], strict=True)):
                assert g_.dtype == w.dtype == torch.bfloat16, what
                ulps = (ordered(g_) - ordered(w.reshape(g_.shape))).abs()
                assert ulps.max() == 0, f"{what} output {i}: {int((ulps > 0).sum())} elements differ, max {ulps.max()} ulp"
            mixes = ("pre", "post", "comb")[:len(got) - n_streams]
            for name, g_, w in zip(mixes, got[n_streams:], want[n_streams:], strict=True):
                err = (g_ - w.reshape(g_.shape)).abs().max()
                assert err <= MIX_ATOL, f"{what} {name}: max |kernel - eager| {err:.2e}"
    n = model.args.n_layers
    # per step: the sites reading fresh streams (after the embedding, after the Engram) are pre
    # sites; each of the 2n expands is a post_pre or post_collapse site
    assert kinds.count("pre") == 4 and kinds.count("post_pre") + kinds.count("post_collapse") == 2 * 2 * n
