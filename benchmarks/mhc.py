"""mHC stream kernels on the GPU: the fused TileLang ops against eager torch (the `*_ref`, which
compose dsv41c/mhc.py), `torch.compile` of the same refs, and the memory lower bound.

    python3 benchmarks/mhc.py [--dim 5120] [--hc 4] [--tokens 1 64 4096 65536] [--no-compile]
                               [--set NAME=VALUE ...] [--json OUT.json] [--trace]

--set overrides an integer tuning constant of tilelang_kernels/mhc.py before the first kernel is
built (for example `--set _WG_TPW=1 --set _WG_KSPLIT=2`), so a variant sweep is a list of
commands; the table's header repeats the overrides.

--trace (a diagnostic, no timing): the wgmma mixing kernel of pre and post_pre built with phase
marks (`_TRACE` in tilelang_kernels/mhc.py); one call per op and T, then each phase's SM cycles
over the CTAs, and how the CTAs' starts and ends spread (waves, tails).

--variant compares tunings side by side in one process instead (repeatable; `default` for none):

    python3 benchmarks/mhc.py --ops post_pre pre --tokens 4096 65536 \
        --variant default --variant _WG_AHEAD_PRE=1 --variant _WG_BLK=24,_WG_TPW=3

Each variant's kernels are built and checked against the refs, and their calls captured in a CUDA
graph. The graphs are then replayed in turn, `--rounds` times, so the device's drift over the run
falls on every variant alike. The table gives each variant's median, its ratio to the first
variant, and the spread of its rounds.

Bytes that any implementation must move per call (bf16 streams of m x D, one token = one row):
  post_pre, post_collapse: read res m*D and y D, write h_new m*D and x D  -> (2m + 2) * D * 2 B
  pre:                     read h m*D, write x D                          -> (m + 1) * D * 2 B
(the per-token coefficients, 24 + 24 fp32, and fn, 24 x m*D fp32 once, are left out: < 1%).
"% bound" = (bytes / copy bandwidth) / kernel time, where the copy bandwidth is a 4 GiB
device-to-device copy (read + write) measured in the same run.  At T = 1 the bytes are ~100 KB,
so the table also gives the latency against the launch floor: the time of as many back-to-back
launches of an empty-work kernel as the op launches (2 for the mixing ops, 1 for post_collapse).
"in a CUDA graph" replays calls captured in one CUDA graph: the device time alone, without the
host's dispatch of the op (which the plain timing still sees when the host is the slower side).
"""

import argparse
import contextlib
import json

import torch
from dsv41c.tilelang_kernels import mhc as K
from quant import (  # benchmarks/ is the script's path: the codec benchmark's timing
    bench,
    bench_graph,
    capture_graph,
    copy_bandwidth,
    trace_table,
    tuning,
)

HC = {"norm_eps": 1e-20, "hc_eps": 1e-6, "iters": 20}


def inputs(n, m, d, device="cuda"):
    mix = 2 * m + m * m
    return {"y": torch.randn(n, d, device=device).bfloat16(),
            "res": (torch.randn(n, m, d, device=device) * (1 + torch.rand(n, 1, 1, device=device))).bfloat16(),
            "post": 2 * torch.rand(n, m, device=device), "comb": torch.rand(n, m, m, device=device) / m,
            "pre_delayed": torch.rand(n, m, device=device) + 1e-6,
            "fn": torch.randn(mix, m * d, device=device) * (2.0 / (m * d) ** 0.5),
            "scale": 0.5 + torch.rand(3, device=device), "base": torch.randn(mix, device=device) * 0.5}


OPS = {  # name -> (kernel, ref, argument names, mixes, launches, streams read, streams written)
    "post_pre": (K.mhc_post_pre, K.mhc_post_pre_ref,
                 ("y", "res", "post", "comb", "pre_delayed", "fn", "scale", "base"), True, 2),
    "pre": (K.mhc_pre, K.mhc_pre_ref, ("res", "fn", "scale", "base", "pre_delayed"), True, 2),
    "post_collapse": (K.mhc_post_collapse, K.mhc_post_collapse_ref,
                      ("y", "res", "post", "comb", "pre_delayed"), False, 1),
}


def min_bytes(op, n, m, d):
    return (2 * m + 2) * d * 2 * n if op != "pre" else (m + 1) * d * 2 * n


def launch_floor(launches):
    """Milliseconds of `launches` back-to-back launches of a one-element kernel."""
    t = torch.zeros(1, device="cuda")

    def run():
        for _ in range(launches):
            t.add_(1)
    return bench(run, reps=200)


def timed(fn, args, kw, reps=30):
    return bench(lambda: fn(*args, **kw), reps=reps)


def agree(op, got, want):
    """Streams bit-identical, mixes max abs difference."""
    ns = 1 if op == "pre" else 2
    exact = all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got[:ns], want[:ns]))
    mix_err = max(((g - w).abs().max().item() for g, w in zip(got[ns:], want[ns:])), default=0.0)
    return exact, mix_err


def measure(op, n, m, d, compiled, copy_gbs, floor_ms):
    """One table row: op at T = n tokens."""
    kern, ref, names, mixes, _ = OPS[op]
    x = inputs(n, m, d)
    args = tuple(x[k] for k in names)
    kw = HC if mixes else {}
    exact, mix_err = agree(op, kern(*args, **kw), ref(*args, **kw))
    t_k = timed(kern, args, kw)
    t_g = bench_graph(lambda: kern(*args, **kw))
    t_e = timed(ref, args, kw, reps=10)
    t_c = float("nan")
    if compiled is not None:
        try:
            t_c = timed(compiled, args, kw, reps=10)
        except Exception as e:  # noqa: BLE001  (report, do not hide: Inductor may reject a ref)
            print(f"torch.compile of {op} failed at T={n}: {type(e).__name__}: {str(e)[:200]}")
    nbytes = min_bytes(op, n, m, d)
    bound_ms = nbytes / (copy_gbs * 1e9) * 1e3
    return {"op": op, "tokens": n, "dim": d, "hc": m, "bytes": nbytes, "tilelang_ms": t_k,
            "graph_ms": t_g, "graph_pct_bound": 100 * bound_ms / t_g,
            "eager_ms": t_e, "compile_ms": t_c, "bound_ms": bound_ms,
            "pct_bound": 100 * bound_ms / t_k, "compile_pct_bound": 100 * bound_ms / t_c,
            "vs_eager": t_e / t_k, "vs_compile": t_c / t_k,
            "launch_floor_ms": floor_ms, "streams_bit_exact": exact, "mixes_max_abs": mix_err}


def trace(ops, tokens, m, d) -> None:
    """--trace: the wgmma mixing kernel built with its phase marks (`_TRACE` in
    tilelang_kernels/mhc.py; pre and post_pre); per op and T, one call after warm-ups, then each
    phase's SM cycles over the CTAs (`trace_table`).  The finalize kernel is not traced."""
    ops = [op for op in ops if K.column_resident(op, "bfloat16", d)]
    if not ops:
        raise SystemExit("--trace: none of --ops runs the wgmma mixing kernel at this --dim (pre, post_pre)")
    G = d // K._CR_W  # the grid's CTAs: G x at most max(1, waves x SMs // G) token groups
    buf = torch.zeros(max(G, K._CR_WAVES * K._SMS), K.TRACE_SLOTS, dtype=torch.int64, device="cuda")
    K._TRACE = buf.data_ptr()
    print(f"\ndevice: {torch.cuda.get_device_name()}; the mixing kernel's phases in SM cycles, one call after "
          f"warm-ups; dim {d}, hc {m}\n")
    for op in ops:
        kern, _, names, _, _ = OPS[op]
        for n in tokens:
            x = inputs(n, m, d)
            args = tuple(x[k] for k in names)
            for _ in range(3):
                kern(*args, **HC)
            buf.zero_()
            torch.cuda.synchronize()
            kern(*args, **HC)
            torch.cuda.synchronize()
            print(f"{op}, T = {n}: ", end="")
            trace_table(buf[buf[:, 0] != 0].cpu(), K, 0, 3)


@contextlib.contextmanager
def variant(assignments: list[str]):
    """The kernel module's tuning constants set as `--set` sets them, for the block only; the build
    and plan caches (keyed by op, not by tuning) cleared on the way in and out."""
    saved = {n: getattr(K, n) for n in (a.partition("=")[0] for a in assignments) if hasattr(K, n)}
    try:
        K.build.cache_clear()
        K._plan.cache_clear()
        yield tuning(K, assignments)
    finally:
        for name, value in saved.items():
            setattr(K, name, value)
        K.build.cache_clear()
        K._plan.cache_clear()


def side_by_side(ops, tokens, m, d, variants, copy_gbs, rounds, inner=8):
    """Rows of the --variant table: per op and T, each variant's graph time (median over rounds)."""
    rows = []
    for op in ops:
        kern, ref, names, mixes, _ = OPS[op]
        kw = HC if mixes else {}
        eps = tuple(HC.values()) if mixes else (0.0, 0.0, 0)
        cases = {}
        for n in tokens:
            x = inputs(n, m, d)
            args = tuple(x[k] for k in names)
            cases[n] = args, ref(*args, **kw)
        runs, held = {n: [] for n in tokens}, []
        for v in variants:  # one build per variant and op (T is dynamic), every T captured with it
            with variant(v):
                for n, (args, want) in cases.items():
                    exact, mix_err = agree(op, kern(*args, **kw), want)
                    held.append(K._plan(op, K._signature(args), eps))  # its kernels outlive the caches
                    runs[n].append((v, exact, mix_err, capture_graph(lambda: kern(*args, **kw), inner)))  # noqa: B023
        for n in tokens:
            times = [[] for _ in runs[n]]
            for _ in range(rounds):
                for t, (_, _, _, graph) in zip(times, runs[n], strict=True):
                    t.append(float("nan") if graph is None else bench(graph.replay, warmup=1, reps=5, inner=1) / inner)
            bound_ms = min_bytes(op, n, m, d) / (copy_gbs * 1e9) * 1e3
            first = None
            for t, (v, exact, mix_err, _) in zip(times, runs[n], strict=True):
                med = sorted(t)[len(t) // 2]
                first = med if first is None else first
                rows.append({"op": op, "tokens": n, "variant": ",".join(v) or "default", "graph_ms": med,
                             "graph_pct_bound": 100 * bound_ms / med, "vs_first": first / med,
                             "spread": (max(t) - min(t)) / med, "streams_bit_exact": exact, "mixes_max_abs": mix_err})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--hc", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096, 65536])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the refs")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override an integer tuning constant of tilelang_kernels/mhc.py")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                    help="a tuning to time side by side with the others (`default`: none); see the docstring")
    ap.add_argument("--rounds", type=int, default=5, help="with --variant: replays of every variant in turn")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true",
                    help="instead of timing: the mixing kernel's phases in SM cycles (pre, post_pre)")
    a = ap.parse_args()
    if a.variant and a.set:
        ap.error("--set and --variant: give the constants in each --variant instead")
    variants = [[] if v == "default" else v.split(",") for v in a.variant]
    for v in variants:  # refused before any timing: a misspelt constant names itself here
        with variant(v):
            pass
    overrides = tuning(K, a.set)
    torch.manual_seed(0)
    m, d = a.hc, a.dim
    if a.trace:
        if variants:
            ap.error("--trace and --variant: trace one build (with --set) at a time")
        trace(a.ops, a.tokens, m, d)
        return
    copy_gbs = copy_bandwidth()
    if variants:
        rows = side_by_side(a.ops, a.tokens, m, d, variants, copy_gbs, a.rounds)
        print(f"\ndevice: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s; in a CUDA graph, "
              f"median of {a.rounds} rounds of every variant in turn\n")
        print("| op | T | variant | in a CUDA graph us | % bound | x first variant | spread | streams exact "
              "| mixes max abs |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {r['tokens']} | {r['variant']} | {r['graph_ms'] * 1e3:.1f} | "
                  f"{r['graph_pct_bound']:.0f}% | {r['vs_first']:.3f} | {100 * r['spread']:.1f}% | "
                  f"{r['streams_bit_exact']} | {r['mixes_max_abs']:.1e} |")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"copy_gb_s": copy_gbs, "device": torch.cuda.get_device_name(), "rounds": a.rounds,
                           "rows": rows}, fh, indent=2)
        return
    floors = {k: launch_floor(k) for k in (1, 2)}
    rows = []
    for op in a.ops:
        _, ref, _, mixes, launches = OPS[op]
        compiled = None if a.no_compile else torch.compile(ref, dynamic=False)
        for n in a.tokens:
            rows.append(measure(op, n, m, d, compiled, copy_gbs, floors[launches]))
    print(f"\ndevice: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (4 GiB device-to-device, "
          f"read + write); launch floor {floors[1] * 1e3:.1f} us (1 launch), {floors[2] * 1e3:.1f} us (2)"
          f"{'; overrides ' + ', '.join(f'{k}={v}' for k, v in overrides.items()) if overrides else ''}\n")
    print("| op | T | MB moved | TileLang us | % bound | in a CUDA graph us | % bound | eager us | x eager | compile us | compile % bound "
          "| x compile | launch floor us | streams exact | mixes max abs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['tokens']} | {r['bytes'] / 1e6:.2f} | {r['tilelang_ms'] * 1e3:.1f} | "
              f"{r['pct_bound']:.0f}% | {r['graph_ms'] * 1e3:.1f} | {r['graph_pct_bound']:.0f}% | "
              f"{r['eager_ms'] * 1e3:.1f} | {r['vs_eager']:.1f} | {r['compile_ms'] * 1e3:.1f} | "
              f"{r['compile_pct_bound']:.0f}% | {r['vs_compile']:.1f} | {r['launch_floor_ms'] * 1e3:.1f} | "
              f"{r['streams_bit_exact']} | {r['mixes_max_abs']:.1e} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_gb_s": copy_gbs, "device": torch.cuda.get_device_name(), "launch_floor_ms": floors,
                       "overrides": overrides, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
