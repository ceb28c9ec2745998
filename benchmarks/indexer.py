"""Indexer at decode on the GPU: scoring straight from the packed MXFP4 index keys, and scoring
plus the top-k and the candidate funnel, against eager torch, `torch.compile` of the eager
reference, and the bytes-moved bound.

    python3 benchmarks/indexer.py [--batch 1 32] [--context 8192 65536 262144] [--set NAME=VALUE ...]
                                  [--json OUT.json] [--select-phases] [--key-spread BITS]
                                  [--ablate nodecode|nomul|noload]

--select-phases times only the top-k, launch by launch (see `select_phases`).
--set overrides an integer constant of tilelang_kernels/indexer.py before the first build (a variant
to time against the default in the same run); the table's header repeats the overrides.
--ablate (timing only: the scores are wrong) replaces the scoring's key decode (`dsv41c_decode16`)
before the first build, to measure what the parts cost: "nomul" keeps the bit moves and drops the
scale multiplies, "nodecode" passes the code words through as operands (the key loads stay),
"noload" feeds constants (the key loads go too: the GEMMs, the epilogue and the walk remain).
It times the bf16 keys' build (`_FP8_KEYS` 0), whose decode that is.

One decode step per sequence (S = 1) at the released indexer dims: H_I = 32 heads x d_I = 128,
n = context index keys (ratio 1: the candidate source), top-k 512, 2048 candidate blocks of 8.
The queries are MXFP4, as the model's are (§6.5(b)), so the scoring takes its E4M3 keys' path
(`_FP8_KEYS`); `--set _FP8_KEYS=0` times the bf16 one.

Variants, each timed with CUDA events (median of batches of back-to-back calls):
  score          tilelang `index_scores` with the block max (what the candidate source needs)
  score+topk     the candidate source's whole step: `index_scores` + `candidate_blocks` (2048
                 blocks) + `index_topk` (k = 512) given the funnel's flags (it reads only the
                 kept blocks' scores, as lower_indexer wires it: 2048 > 512)
  reindex        a Reindex layer's step: `index_scores` masked by the candidate blocks (the kernel
                 reads only the kept blocks' keys) + `index_topk` given the same flags (it reads
                 only the kept blocks' scores)
  eager          the same in eager torch as the eager model runs it with packed storage: dequantise
                 all n keys to bf16, einsum, relu, x w, sum over heads; topk(sorted=False) + sort;
                 `Indexer.candidate_mask` (block max, pin, topk, mask)
  compile        `torch.compile` of the eager functions
Bytes any implementation must move per sequence: the n packed keys (68 B each), q and w
(H x d + H bf16); plus, for "score", the written scores (2 B per key) and block maxima (2 B per
block); for "score+topk", only the k int32 indices and the block flags (1 B per block); for
"reindex", only the kept blocks' keys, the block flags read and the k indices written.
"% bound" = (bytes / copy bandwidth) / time, where the copy bandwidth is a 4 GiB device-to-device
copy (read + write) measured in the same run.  Consecutive calls cycle through enough copies of
the key cache (>= 200 MB in all, at most 16 copies) that the keys come from HBM, not from L2.
"""

import argparse
import json
import types

import torch
from dsv41c import quant as Q
from dsv41c.attention import Indexer
from dsv41c.tilelang_kernels import indexer as K
from quant import (  # benchmarks/ is the script's path: the codec benchmark's timing
    bench,
    bench_graph,
    copy_bandwidth,
    tuning,
)

H, D = 32, 128

# --ablate: replacement bodies of dsv41c_decode16 (the signature line is kept)
_ABLATIONS = {
    "nodecode": """
  uint4 c = *reinterpret_cast<const uint4*>(codes);
  unsigned words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int r = 0; r < 16; ++r) o[r] = words[r & 3] ^ (s << (r & 7));
}
""",
    "nomul": """
  uint4 c = *reinterpret_cast<const uint4*>(codes);
  unsigned words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) dsv41c_e2m1_words(words[q], o + 4 * q);
  o[0] ^= s;
}
""",
    "noload": """
#pragma unroll
  for (int r = 0; r < 16; ++r) o[r] = 0x3F803F80u + r;
}
""",
}


def ablate(part: str) -> None:
    """Replace the scoring's key decode by the `_ABLATIONS` body `part` (before the first build), in
    the bf16 keys' build (the E4M3 build's fast path has its own decode)."""
    K._FP8_KEYS = 0
    src = K._DECODE_PRELUDE
    i = src.index("__device__ __forceinline__ void dsv41c_decode16(")
    i = src.index("{", i) + 1
    j = src.index("\n}\n", i) + 3
    K._DECODE_PRELUDE = src[:i] + _ABLATIONS[part] + src[j:]


def make_caches(b, n, copies, spread=4.0):
    """`copies` packed key caches [b, n] (codes, scales) and one query's q, w per sequence.  Each key
    is N(0, 1) times 2^U(0, spread): at the default 4, most warps meet a scale byte above 128 and
    the decode takes its two-multiply path; at 0 (unit-RMS keys, as a k_norm with unit weight
    gives) it takes the one-multiply path (`_DECODE_PRELUDE`)."""
    caches = []
    for _ in range(copies):
        keys = (torch.randn(b, n, D, device="cuda") * torch.rand(b, n, 1, device="cuda").mul(spread).exp2()).bfloat16()
        caches.append(Q.mxfp4_quant_ref(keys))
    q = Q.fp4_ue8m0_fake_quant(torch.randn(b, 1, H, D, device="cuda").bfloat16(), 32)
    w = (torch.randn(b, 1, H, device="cuda") * (H * D) ** -0.5).bfloat16()
    return caches, q, w


def eager_score(q, codes, scales, w):
    return K.index_scores_ref(q, codes, scales, w, block_max=False)[0]


def eager_step(q, codes, scales, w, vl, k, kb):
    """The eager model's decode step at the candidate source (bf16 torch.topk, as it runs)."""
    scores = K.index_scores_ref(q, codes, scales, w, block_max=False)[0]
    idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    idx = torch.where(idx >= vl.view(1, -1, 1), -1, idx + 128).int()
    funnel = types.SimpleNamespace(block_size=K.BLOCK, topk_blocks=kb)
    return idx, Indexer.candidate_mask(funnel, scores, vl.long())


def eager_reindex(q, codes, scales, w, vl, k, keep):
    scores = K.index_scores_ref(q, codes, scales, w, block_max=False)[0]
    scores = scores.masked_fill(~K.expand_blocks(keep, scores.shape[-1]), float("-inf"))
    idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return torch.where(idx >= vl.view(1, -1, 1), -1, idx + 128).int()


def kernel_reindex(q, codes, scales, w, vl, k, keep):
    sc, _ = K.index_scores(q, codes, scales, w, None, keep)
    return K.index_topk(sc, vl, keep, k=k, offset=128)


def kernel_score(q, codes, scales, w):
    return K.index_scores(q, codes, scales, w, block_max=True)


def kernel_step(q, codes, scales, w, vl, k, kb):
    """The candidate source as lower_indexer wires it: the top-k given the funnel's flags where
    those keep it (`funnel_keeps_topk`: 2048 blocks for a top-512)."""
    sc, bm = K.index_scores(q, codes, scales, w, block_max=True)
    keep = K.candidate_blocks(bm, vl, topk_blocks=kb)
    return K.index_topk(sc, vl, keep if K.funnel_keeps_topk(kb, k) else None, k=k, offset=128), keep


def cycling(fn, caches, q, w, *rest):
    """fn on the next key cache at every call."""
    it = [0]

    def run():
        codes, scales = caches[it[0] % len(caches)]
        it[0] += 1
        return fn(q, codes, scales, w, *rest)
    return run


def select_phases(batches, contexts, k, blocks) -> None:
    """Device time of each CUDA select launch of one `index_topk` call (the top-k alone, no
    scoring): every prefix of the launches (zeroed histograms first) captured in a CUDA graph and
    replayed, the differences printed; on dense random scores and on Reindex-like scores (`blocks`
    random blocks of 8 kept, -inf elsewhere) with and without the candidate flags, 8 copies cycled
    so the scores come from HBM."""
    print(f"\ndevice: {torch.cuda.get_device_name()}; index_topk k = {k}, select launches {K.SELECT_PHASES}\n")
    print("| B | n | scores | flags | zeroing us | " + " | ".join(f"{p} us" for p in K.SELECT_PHASES)
          + " | index_topk us | exact |")
    print("|---:|---:|---|---|" + "---:|" * (len(K.SELECT_PHASES) + 2) + "---|")
    for b in batches:
        for n in contexts:
            vl = torch.tensor([n], dtype=torch.int32, device="cuda")
            part = K.cuda_select_split(n, b)[1]
            nb = -(-n // K.BLOCK)
            for kind, flags in (("dense", False), ("reindex", False), ("reindex", True)):
                copies = []
                for _ in range(8):
                    sc, keep = torch.randn(b, 1, n, device="cuda").bfloat16(), None
                    if kind == "reindex":
                        keep = torch.rand(b, 1, nb, device="cuda") < blocks / nb
                        sc.masked_fill_(~K.expand_blocks(keep, n), float("-inf"))
                    copies.append((sc, keep if flags else None))
                if flags and not K.cuda_select_gathers(part):
                    continue  # index_topk takes the dense walk (the row above) for such parts
                out = torch.empty(b, 1, k, dtype=torch.int32, device="cuda")
                t = [bench_graph(select_launches(copies, vl, k, out, K.SELECT_PHASES[:m])) * 1e3
                     for m in range(len(K.SELECT_PHASES) + 1)]
                topk = cycling_copies(copies, lambda sc, keep, vl=vl: K.index_topk(sc, vl, keep, k=k, offset=128))
                full = bench_graph(topk) * 1e3
                sc, keep = copies[1]
                exact = torch.equal(K.index_topk(sc, vl, keep, k=k, offset=128).cpu(),
                                    K.index_topk_ref(sc.cpu(), vl.cpu(), k=k, offset=128))
                print(f"| {b} | {n} | {kind} | {'yes' if flags else 'no'} | {t[0]:.1f} | "
                      + " | ".join(f"{t[i + 1] - t[i]:.1f}" for i in range(len(K.SELECT_PHASES)))
                      + f" | {full:.1f} | {exact} |")


def select_launches(copies, vl, k, out, phases):
    """The select of one top-k on the next copy as `index_topk` runs it (zeroed histograms, the
    candidate mode where the copy has flags and its parts take it), its launches cut to `phases`."""
    return cycling_copies(copies, lambda sc, keep: K._select("topk", sc, vl, k, 128, out, keep, phases))


def cycling_copies(copies, fn):
    """fn(scores, flags) on the next of the (scores, flags) copies at every call."""
    it = [0]

    def run():
        it[0] += 1
        return fn(*copies[it[0] % len(copies)])
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the eager functions")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager timings")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override an integer constant of tilelang_kernels/indexer.py (a kernel variant)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--key-spread", type=float, default=4.0, metavar="BITS",
                    help="keys are N(0, 1) x 2^U(0, BITS) (default 4; 0: unit-RMS keys)")
    ap.add_argument("--ablate", choices=sorted(_ABLATIONS), default=None,
                    help="timing only (wrong scores): the scoring with part of its key decode removed")
    ap.add_argument("--select-phases", action="store_true",
                    help="only the top-k: the device time of each of its launches (no scoring, not the main table)")
    a = ap.parse_args()
    overrides = tuning(K, a.set)
    if a.ablate:
        ablate(a.ablate)
    if a.select_phases:
        select_phases(a.batch, a.context, a.topk, a.blocks)
        return
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    comp_score = None if a.no_compile else torch.compile(eager_score, dynamic=False)
    comp_step = None if a.no_compile else torch.compile(eager_step, dynamic=False)
    comp_reindex = None if a.no_compile else torch.compile(eager_reindex, dynamic=False)
    rows = []
    for b in a.batch:
        for n in a.context:
            key_bytes = b * n * 68
            caches, q, w = make_caches(b, n, max(1, min(16, (200 << 20) // key_bytes)), a.key_spread)
            vl = torch.tensor([n], dtype=torch.int32, device="cuda")
            k, kb = min(a.topk, n), a.blocks
            nb = -(-n // K.BLOCK)
            io = b * (H * D + H) * 2
            variants = {"score": (kernel_score, eager_score, comp_score, (),
                                  key_bytes + io + b * (n + nb) * 2),
                        "score+topk": (kernel_step, eager_step, comp_step, (vl, k, kb),
                                       key_bytes + io + b * (k * 4 + nb))}
            keep = K.candidate_blocks(K.index_scores(q, *caches[0], w, block_max=True)[1], vl, topk_blocks=kb)
            kept = int(keep.sum())
            variants["reindex"] = (kernel_reindex, eager_reindex, comp_reindex, (vl, k, keep),
                                   kept * K.BLOCK * 68 + io + b * (nb + k * 4))
            # the kernels' selection (the step's, given the funnel's flags) against the reference
            # on the same scores, the whole rows
            sc, _ = K.index_scores(q, *caches[0], w, block_max=True)
            exact_topk = torch.equal(kernel_step(q, *caches[0], w, vl, k, kb)[0],
                                     K.index_topk_ref(sc, vl, k=k, offset=128))
            for name, (kern, eager, comp, rest, nbytes) in variants.items():
                times = {}
                for label, fn in (("tilelang", kern), ("eager", None if a.no_eager else eager), ("compile", comp)):
                    if fn is None:
                        times[label] = float("nan")
                        continue
                    run = cycling(fn, caches, q, w, *rest)
                    try:
                        times[label] = bench(run, reps=30 if label == "tilelang" else 10)
                    except Exception as e:  # noqa: BLE001  (report, do not hide: Inductor may reject a ref)
                        print(f"{label} of {name} failed at B={b}, n={n}: {type(e).__name__}: {str(e)[:200]}")
                        times[label] = float("nan")
                graph_ms = bench_graph(cycling(kern, caches, q, w, *rest))
                bound_ms = nbytes / (copy_gbs * 1e9) * 1e3
                rows.append({"variant": name, "batch": b, "context": n, "bytes": nbytes,
                             "tilelang_ms": times["tilelang"], "graph_ms": graph_ms,
                             "graph_pct_bound": 100 * bound_ms / graph_ms, "eager_ms": times["eager"],
                             "compile_ms": times["compile"], "bound_ms": bound_ms,
                             "pct_bound": 100 * bound_ms / times["tilelang"],
                             "compile_pct_bound": 100 * bound_ms / times["compile"],
                             "vs_eager": times["eager"] / times["tilelang"],
                             "vs_compile": times["compile"] / times["tilelang"], "topk_exact": exact_topk})
            del caches
            torch.cuda.empty_cache()
    print(f"\ndevice: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (4 GiB device-to-device, "
          f"read + write); H_I = {H} x d_I = {D}, top-k {a.topk}, {a.blocks} candidate blocks of {K.BLOCK}"
          f"; keys N(0, 1) x 2^U(0, {a.key_spread:g})"
          f"{'; overrides ' + ', '.join(f'{k}={v}' for k, v in overrides.items()) if overrides else ''}"
          f"{'; ablated (timing only, wrong scores): ' + a.ablate if a.ablate else ''}\n")
    print("| variant | B | context | MB moved | TileLang us | % bound | in a CUDA graph us | % bound | eager us | x eager | compile us "
          "| compile % bound | x compile | top-k exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['batch']} | {r['context']} | {r['bytes'] / 1e6:.2f} | "
              f"{r['tilelang_ms'] * 1e3:.1f} | {r['pct_bound']:.0f}% | {r['graph_ms'] * 1e3:.1f} | "
              f"{r['graph_pct_bound']:.0f}% | {r['eager_ms'] * 1e3:.1f} | "
              f"{r['vs_eager']:.1f} | {r['compile_ms'] * 1e3:.1f} | {r['compile_pct_bound']:.0f}% | "
              f"{r['vs_compile']:.1f} | {r['topk_exact']} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_gb_s": copy_gbs, "device": torch.cuda.get_device_name(), "heads": H, "head_dim": D,
                       "topk": a.topk, "candidate_blocks": a.blocks, "key_spread": a.key_spread, "overrides": overrides,
                       "rows": rows}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
