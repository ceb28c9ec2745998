"""Sparse attention at decode on the GPU: the TileLang kernel that reads the packed caches against
eager torch, `torch.compile` of the eager reference, and the bytes-moved bound.

    python3 benchmarks/attention.py [--batch 1 32] [--context 8192 65536 262144] [--set NAME=VALUE ...]
                                    [--json OUT.json] [--ablate nodecode|nosoftmax] [--trace]

--set overrides an integer constant of tilelang_kernels/attention.py before the first build (a variant
to time against the default in the same run); the header repeats the overrides.
--ablate (timing only: the outputs are wrong) replaces a part of the CUDA kernel before the first
build, to measure what it costs: "nodecode" turns the packed rows' decode (`dsv41c_fp8_row8`,
`dsv41c_fp4_row8`) into a few bit moves of the codes (their loads from the stage and the tile's
stores stay), "nosoftmax" leaves the scores as they are (`dsv41c_softmax_block`: no masks, maxima,
exponentials, or the exchange between the warpgroups and its barrier; the GEMMs and the copy of P
stay).
--trace (a diagnostic, no timing): the kernel built with its phase marks (`_TRACE` in
tilelang_kernels/attention.py); one call per batch, then each phase's SM cycles over the CTAs.

One decode step per sequence (S = 1) at the released attention dims: H = 64 heads x d = 512,
an FP8 ring of 128 window rows and n_c = context / ratio FP4 compressed rows (ratio 2, the
released kv sources), of which the index list names the top-k = 512 (ascending, as the indexer
emits them), after the 128 ring slots: K = 640 entries.

The kernel splits each query's list over several CTAs when the batch alone does not fill the SMs
(`num_splits` in tilelang_kernels/attention.py; "CTAs/query" in the table), then merges the splits
with a second kernel (at batch 32 pairs of CTAs first merge theirs on chip, `pair_merged`): all of
it is in the times.

Variants, each timed with CUDA events (median of batches of back-to-back calls):
  tilelang       `sparse_attn_packed`: gathers the listed rows from the packed bytes ("in a CUDA
                 graph": the same calls captured in a graph and replayed, the device time alone)
  tilelang rows  `sparse_attn` over the same rows already in bf16 (1 KB per row: the cost of the
                 unpacked cache, for comparison)
  eager          `sparse_attn_packed_ref` in eager torch: what the eager model does with packed
                 storage (dequantise the window and all n_c compressed rows, concatenate, gather)
  eager rows     `sparse_attn_ref` over rows already in bf16 (a plain bf16 cache; no dequantise)
  compile        `torch.compile` of `sparse_attn_packed_ref`
Bytes any implementation must move: per sequence the listed rows in their packed form (528 B per
window row, 288 B per compressed row), q and o (H x d bf16 each), the index list (4 B per entry).
"% bound" = (bytes / copy bandwidth) / time, where the copy bandwidth is a 4 GiB device-to-device
copy (read + write) measured in the same run.  Each call uses the next of `--lists` different
random index lists, so at long contexts the rows come from HBM rather than from the previous
call's L2 lines (at 8K context the whole compressed cache, 1.2 MB per sequence, fits in L2).
"""

import argparse
import itertools
import json

import torch
from dsv41c import quant as Q
from dsv41c.tilelang_kernels import attention as A
from quant import (  # benchmarks/ is the script's path: the codec benchmark's timing
    bench,
    bench_graph,
    copy_bandwidth,
    trace_table,
    tuning,
)

H, D, WINDOW, TOPK = 64, 512, 128, 512


def decode_case(batch, n_c, lists, g):
    """Packed caches, q, sink and `lists` index lists [B,1,WINDOW+TOPK] (every entry valid)."""
    q = torch.randn(batch, 1, H, D, generator=g, device="cuda").bfloat16()
    ring, ring_scales = Q.fp8_quant_ref(torch.randn(batch, WINDOW, D, generator=g, device="cuda"))
    codes, scales = Q.fp4_e4m3_quant_ref(torch.randn(batch, n_c, D, generator=g, device="cuda"))
    sink = torch.randn(H, generator=g, device="cuda")
    slots = torch.arange(WINDOW, device="cuda").repeat(batch, 1)
    idx = []
    for _ in range(lists):
        top = torch.rand(batch, n_c, generator=g, device="cuda").topk(TOPK, dim=-1).indices
        idx.append(torch.cat([slots, top.sort(dim=-1).values + WINDOW], dim=-1).int().unsqueeze(1))
    return q, ring, ring_scales, codes, scales, sink, idx


def min_bytes(batch):
    per_seq = WINDOW * (D + D // 32) + TOPK * (D // 2 + D // 16) + 2 * (H * D * 2) + 4 * (WINDOW + TOPK)
    return batch * per_seq + 4 * H


def rotating(fn, first_args, lists, last_args):
    """A callable that runs fn with the next index list on each call."""
    it = itertools.cycle(lists)
    return lambda: fn(*first_args, next(it), *last_args)


# --ablate: replacement bodies of prelude functions of tilelang_kernels/attention.py (the signature
# line is kept): prelude variable -> (function, body)
_ABLATIONS = {
    "nodecode": [("_ROW8_PRELUDE", "dsv41c_fp8_row8", """
  const uint2 c = *reinterpret_cast<const uint2*>(codes);
  *reinterpret_cast<uint4*>(out) = make_uint4(c.x & 0x3F3F3F3Fu, c.y & 0x3F3F3F3Fu, (c.x ^ s) & 0x3F3F3F3Fu,
                                              (c.y >> 1) & 0x3F3F3F3Fu);
}
"""), ("_ROW8_PRELUDE", "dsv41c_fp4_row8", """
  const unsigned c = *reinterpret_cast<const unsigned*>(codes);
  *reinterpret_cast<uint4*>(out) = make_uint4(c & 0x3F3F3F3Fu, (c >> 1) & 0x3F3F3F3Fu, (c ^ s) & 0x3F3F3F3Fu,
                                              (c >> 2) & 0x3F3F3F3Fu);
}
""")],
    "nosoftmax": [("_SOFTMAX_PRELUDE", "dsv41c_softmax_block", """
  alpha[0] = 1.0f;
  alpha[1] = 1.0f;
}
""")],
}


def ablate(part: str) -> None:
    """Replace the `_ABLATIONS` functions of `part` in the kernel module's preludes (before the first build)."""
    for var, fn, body in _ABLATIONS[part]:
        src = getattr(A, var)
        i = src.index("{", src.index(f"__device__ __forceinline__ void {fn}(")) + 1
        j = src.index("\n}\n", i) + 3
        setattr(A, var, src[:i] + body + src[j:])


def trace(batches, context, ratio, lists, g) -> None:
    """--trace: thread 0 of every CTA of the attention kernel (the split kernel; at batches that fill
    the SMs, the whole-list one) records its SM clock at the phase boundaries of one
    `sparse_attn_packed` call (`_TRACE` in tilelang_kernels/attention.py); prints, per batch, the
    median and the largest cycles of each phase over the CTAs, and the global timer's spread of the
    CTAs' starts and ends (the marks' own cost is a store by one thread each).  The combine kernel
    is not traced."""
    blocks = -(-(WINDOW + TOPK) // A.BLOCK)  # a query's CTAs are at most its list's blocks
    buf = torch.zeros(max(batches) * blocks * -(-H // 64), A.TRACE_SLOTS, dtype=torch.int64, device="cuda")
    A._TRACE = buf.data_ptr()
    scale = D**-0.5
    print(f"\ndevice: {torch.cuda.get_device_name()}; the attention kernel's phases in SM cycles (thread 0 of each "
          f"CTA), one call after warm-ups; context {context // 1024}K\n")
    for batch in batches:
        q, ring, ring_scales, codes, scales, sink, idx = decode_case(batch, context // ratio, lists, g)
        head = (q, ring, ring_scales, codes, scales, sink)
        for i in range(2 * lists):
            A.sparse_attn_packed(*head, idx[i % lists], scale)
        buf.zero_()
        torch.cuda.synchronize()
        A.sparse_attn_packed(*head, idx[0], scale)
        torch.cuda.synchronize()
        t = buf[buf[:, 0] != 0].cpu()
        if not len(t):
            raise SystemExit(f"batch {batch}: no CTA wrote its trace")
        print(f"batch {batch}: ", end="")
        trace_table(t, A, 0, 29)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--ratio", type=int, default=2, help="compression ratio of the kv source")
    ap.add_argument("--lists", type=int, default=8, help="index lists cycled through by the timed calls")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager references")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override an integer constant of tilelang_kernels/attention.py (a kernel variant)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ablate", choices=sorted(_ABLATIONS), default=None,
                    help="timing only, wrong outputs: a part of the CUDA kernel replaced (see above)")
    ap.add_argument("--trace", action="store_true",
                    help="instead of timing: the kernel's phases in SM cycles, at the first --context")
    a = ap.parse_args()
    overrides = tuning(A, a.set)
    if a.ablate:
        ablate(a.ablate)
    g = torch.Generator(device="cuda").manual_seed(0)
    if a.trace:
        trace(a.batch, a.context[0], a.ratio, a.lists, g)
        return
    copy_gbs = copy_bandwidth()
    scale = D**-0.5
    compiled = None if a.no_compile else torch.compile(A.sparse_attn_packed_ref, dynamic=False)
    rows = []
    for batch in a.batch:
        for context in a.context:
            n_c = context // a.ratio
            q, ring, ring_scales, codes, scales, sink, idx = decode_case(batch, n_c, a.lists, g)
            head, tail = (q, ring, ring_scales, codes, scales, sink), (scale,)
            out = A.sparse_attn_packed(*head, idx[0], scale)
            ref = A.sparse_attn_packed_ref(*head, idx[0], scale)
            err = (out.float() - ref.float()).abs().max().item()
            t_k = bench(rotating(A.sparse_attn_packed, head, idx, tail))
            t_g = bench_graph(rotating(A.sparse_attn_packed, head, idx, tail))
            kv = torch.cat([Q.fp8_dequant_ref(ring, ring_scales, torch.bfloat16),
                            Q.fp4_e4m3_dequant_ref(codes, scales, torch.bfloat16)], dim=1)
            t_kr = bench(rotating(A.sparse_attn, (q, kv, sink), idx, tail))
            t_e = t_r = t_c = float("nan")
            if not a.no_eager:
                t_e = bench(rotating(A.sparse_attn_packed_ref, head, idx, tail), reps=10)
                t_r = bench(rotating(A.sparse_attn_ref, (q, kv, sink), idx, tail), reps=10)
            del kv
            if compiled is not None:
                try:
                    t_c = bench(rotating(compiled, head, idx, tail), reps=10)
                except Exception as e:  # noqa: BLE001  (report, do not hide: Inductor may reject the ref)
                    print(f"torch.compile failed at batch {batch}, context {context}: {type(e).__name__}: "
                          f"{str(e)[:200]}")
            splits = A.num_splits(batch * -(-H // 64), -(-(WINDOW + TOPK) // A.BLOCK),
                                  torch.cuda.get_device_properties(0).multi_processor_count)
            nbytes = min_bytes(batch)
            bound_ms = nbytes / (copy_gbs * 1e9) * 1e3
            rows.append({"batch": batch, "context": context, "compressed_rows": n_c, "ctas_per_query": splits,
                         "bytes": nbytes,
                         "tilelang_ms": t_k, "graph_ms": t_g, "graph_pct_bound": 100 * bound_ms / t_g,
                         "tilelang_rows_ms": t_kr, "eager_ms": t_e, "eager_rows_ms": t_r,
                         "compile_ms": t_c,
                         "bound_ms": bound_ms, "pct_bound": 100 * bound_ms / t_k, "vs_eager": t_e / t_k,
                         "vs_eager_rows": t_r / t_k, "vs_compile": t_c / t_k,
                         "compile_pct_bound": 100 * bound_ms / t_c, "max_abs_vs_ref": err})
            del q, ring, ring_scales, codes, scales, idx
            torch.cuda.empty_cache()
    print(f"\ndevice: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (4 GiB device-to-device, "
          f"read + write); H={H}, d={D}, window {WINDOW}, top-k {TOPK}, ratio {a.ratio}"
          f"{'; overrides ' + ', '.join(f'{k}={v}' for k, v in overrides.items()) if overrides else ''}"
          f"{'; ablated (timing only, wrong outputs): ' + a.ablate if a.ablate else ''}\n")
    print("| batch | context | CTAs/query | MB moved | bound us | TileLang us | % bound | in a CUDA graph us | % bound "
          "| TileLang rows us | eager us | x eager "
          "| eager rows us | x eager rows | compile us | compile % bound | x compile | max abs vs ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context'] // 1024}K | {r['ctas_per_query']} | {r['bytes'] / 1e6:.2f} | "
              f"{r['bound_ms'] * 1e3:.1f} | "
              f"{r['tilelang_ms'] * 1e3:.1f} | {r['pct_bound']:.0f}% | {r['graph_ms'] * 1e3:.1f} | "
              f"{r['graph_pct_bound']:.0f}% | {r['tilelang_rows_ms'] * 1e3:.1f} | "
              f"{r['eager_ms'] * 1e3:.0f} | "
              f"{r['vs_eager']:.1f} | {r['eager_rows_ms'] * 1e3:.0f} | {r['vs_eager_rows']:.1f} | "
              f"{r['compile_ms'] * 1e3:.0f} | {r['compile_pct_bound']:.0f}% | {r['vs_compile']:.1f} | "
              f"{r['max_abs_vs_ref']:.1e} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_gb_s": copy_gbs, "device": torch.cuda.get_device_name(), "heads": H, "head_dim": D,
                       "window": WINDOW, "topk": TOPK, "ratio": a.ratio, "overrides": overrides, "rows": rows}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
