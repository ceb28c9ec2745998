"""KV codec kernels on the GPU: TileLang quantise/dequantise against eager torch, torch.compile of
the `*_ref`, and the device-to-device copy bandwidth measured in the same run.

    python3 benchmarks/quant.py [--rows 1048576] [--n 512] [--json OUT.json]

Bytes moved per call (bf16 rows of n values): quantise reads 2n B and writes the packed row
(fp8 n + n/32, fp4_e4m3 n/2 + n/16, mxfp4 n/2 + n/32); dequantise reads the packed row and writes
2n B. GB/s = bytes / median time; "% copy" divides by the copy bandwidth (read + write bytes).
"""
from __future__ import annotations

import argparse
import json

import torch

from dsv41c import quant
from dsv41c.tilelang_kernels import quant as tlq

REFS = {
    "fp8": (quant.fp8_quant_ref, quant.fp8_dequant_ref),
    "fp4_e4m3": (quant.fp4_e4m3_quant_ref, quant.fp4_e4m3_dequant_ref),
    "mxfp4": (quant.mxfp4_quant_ref, quant.mxfp4_dequant_ref),
}
KERNELS = {
    "fp8": (tlq.fp8_quant, tlq.fp8_dequant),
    "fp4_e4m3": (tlq.fp4_e4m3_quant, tlq.fp4_e4m3_dequant),
    "mxfp4": (tlq.mxfp4_quant, tlq.mxfp4_dequant),
}


def bench(fn, warmup: int = 5, reps: int = 30, inner: int = 8) -> float:
    """Median milliseconds per call over `reps` CUDA-event-timed batches of `inner` back-to-back
    calls: within a batch the host queues the next launch while the device runs the previous one,
    so the figure is device time, not the Python dispatch of a single call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]


def capture_graph(fn, inner: int = 8):
    """`inner` calls of fn captured in one CUDA graph (after two warm-up calls off the default
    stream), or None, with a message, when they cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                   # warm-up off the default stream
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except RuntimeError as e:
        print(f"CUDA graph capture failed: {str(e)[:200]}")
        return None
    return graph


def bench_graph(fn, inner: int = 8, reps: int = 20) -> float:
    """Median milliseconds per call of `inner` calls captured in one CUDA graph and replayed: the
    device time alone, with no host dispatch (which `bench` still sees once a call's host side is
    slower than its kernel). NaN when the calls cannot be captured."""
    graph = capture_graph(fn, inner)
    return float("nan") if graph is None else bench(graph.replay, warmup=2, reps=reps, inner=1) / inner


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def tuning(module, assignments: list[str]) -> dict[str, int]:
    """Apply `NAME=VALUE` overrides (a benchmark's `--set`) to `module`'s integer tuning constants
    (module attributes in capitals, with or without a leading underscore); returns them.  Must run
    before the first build: the kernel modules cache their builds per process."""
    where = module.__name__.replace(".", "/").removeprefix("dsv41c/") + ".py"
    out = {}
    for a in assignments:
        name, sep, value = a.partition("=")
        if not sep or not name.lstrip("_").isupper() or not isinstance(getattr(module, name, None), int):
            raise SystemExit(f"--set {a!r}: not NAME=VALUE with NAME an integer constant of {where}")
        try:
            out[name] = int(value)
        except ValueError:
            raise SystemExit(f"--set {a!r}: {value!r} is not an integer") from None
        setattr(module, name, out[name])
    return out


def trace_table(rows: torch.Tensor, module, start: int, end: int) -> None:
    """Print a kernel's phase trace (a kernel module's `_TRACE` buffer, the rows of the CTAs that
    wrote it, on the host): the CTAs and SMs, the global timer's spread of the CTAs' starts and
    ends, then per mark the median (of an even count, the lower middle value) and largest SM cycles
    since the CTA's previous mark, over the CTAs that have both.  The marks are
    `module._TRACE_CHAINS`, lists of slots in time order (the marks of one thread, or of threads
    that wait for each other), labelled by `_TRACE_MARKS`; start and end: the slots of the first
    and the last marks (their global timer: `_TRACE_T0`, `_TRACE_T1`)."""
    t0, t1 = rows[:, module._TRACE_T0], rows[:, module._TRACE_T1]
    ghz = ((rows[:, end] - rows[:, start]).double() / (t1 - t0).double()).median().item()
    late = int((t0 > t1.min()).sum())
    print(f"{len(rows)} CTAs on {rows[:, module._TRACE_SM].unique().numel()} SMs; global timer: starts spread over "
          f"{(t0.max() - t0.min()) / 1e3:.2f} us, ends over {(t1.max() - t1.min()) / 1e3:.2f} us, first start to "
          f"last end {(t1.max() - t0.min()) / 1e3:.2f} us; {late} CTAs started after the first one ended; SM clock "
          f"{ghz:.2f} GHz\n")
    print("| phase (cycles since the previous mark) | CTAs | median | max |")
    print("|---|---:|---:|---:|")
    for chain in module._TRACE_CHAINS:
        prev = torch.zeros(len(rows), dtype=torch.int64)
        prev_set = torch.zeros(len(rows), dtype=torch.bool)
        for k in chain:
            have = rows[:, k] != 0
            sel = have & prev_set
            if sel.any():
                d = (rows[sel, k] - prev[sel]).double()
                print(f"| {module._TRACE_MARKS[k]} | {int(sel.sum())} | {d.median().item():.0f} | "
                      f"{d.max().item():.0f} |")
            prev = torch.where(have, rows[:, k], prev)
            prev_set |= have
    d = (rows[:, end] - rows[:, start]).double()
    print(f"| whole CTA | {len(rows)} | {d.median().item():.0f} | {d.max().item():.0f} |\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=tlq._CUDA_THREADS, help="CUDA threads per CTA")
    ap.add_argument("--unroll", type=int, default=tlq._UNROLL, help="CUDA chunks of 8 values per thread")
    ap.add_argument("--sweep", action="store_true",
                    help="time the CUDA launch shapes (threads per CTA x chunks per thread) instead")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a.rows, a.n)
    tlq._CUDA_THREADS, tlq._UNROLL = a.threads, a.unroll
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    x = (torch.randn(a.rows, a.n, device="cuda") * torch.rand(a.rows, 1, device="cuda") * 10).bfloat16()
    rows = []
    for fmt in REFS:
        (qref, dref), (qk, dk) = REFS[fmt], KERNELS[fmt]
        codes, scales = qk(x)
        exact_q = [torch.equal(t, r) for t, r in zip((codes, scales), qref(x))]
        y = dk(codes, scales, torch.bfloat16)
        exact_d = torch.equal(y.view(torch.int16), dref(codes, scales, torch.bfloat16).view(torch.int16))
        packed = codes.numel() + scales.numel()
        for direction, kern, ref, args, nbytes in (
            ("quant", qk, qref, (x,), x.numel() * 2 + packed),
            ("dequant", lambda c, s: dk(c, s, torch.bfloat16), lambda c, s: dref(c, s, torch.bfloat16),
             (codes, scales), packed + x.numel() * 2),
        ):
            t_k = bench(lambda: kern(*args))
            t_e = bench(lambda: ref(*args), reps=10)
            try:
                compiled = torch.compile(ref)
                t_c = bench(lambda: compiled(*args), reps=10)
            except Exception as e:          # report, do not hide: some refs use ops Inductor rejects
                print(f"torch.compile of {fmt} {direction} ref failed: {type(e).__name__}: {str(e)[:200]}")
                t_c = float("nan")
            gbs = nbytes / (t_k * 1e-3) / 1e9
            rows.append({"format": fmt, "direction": direction, "rows": a.rows, "n": a.n, "bytes": nbytes,
                         "tilelang_ms": t_k, "eager_ms": t_e, "compile_ms": t_c, "gb_s": gbs,
                         "pct_copy": 100 * gbs / copy_gbs, "vs_eager": t_e / t_k, "vs_compile": t_c / t_k,
                         "bit_exact": all(exact_q) if direction == "quant" else exact_d})
    print(f"\ndevice: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s "
          f"(4 GiB device-to-device, read + write); {a.threads} threads x {a.unroll} chunks\n")
    print(f"| format | op | {a.rows}x{a.n} bf16: MB moved | TileLang ms | GB/s | % copy | eager ms | x eager "
          f"| compile ms | x compile | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['direction']} | {r['bytes'] / 1e6:.0f} | {r['tilelang_ms']:.3f} | "
              f"{r['gb_s']:.0f} | {r['pct_copy']:.0f}% | {r['eager_ms']:.3f} | {r['vs_eager']:.1f} | "
              f"{r['compile_ms']:.3f} | {r['vs_compile']:.1f} | {r['bit_exact']} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_gb_s": copy_gbs, "device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=2)


def sweep(n_rows: int, n: int) -> None:
    """Kernel time per launch shape; each shape is checked bit-exact against the ref first."""
    copy_gbs = copy_bandwidth()
    x = (torch.randn(n_rows, n, device="cuda") * torch.rand(n_rows, 1, device="cuda") * 10).bfloat16()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; % of copy per kernel, {n_rows}x{n} bf16")
    print("| threads | chunks/thread | " + " | ".join(f"{f} {d}" for f in REFS for d in ("quant", "dequant")) + " |")
    print("|---|---|" + "---|" * 6)
    for threads in (128, 256, 512):
        for unroll in (1, 2, 4, 8):
            tlq._CUDA_THREADS, tlq._UNROLL = threads, unroll
            tlq.build.cache_clear()
            cells = []
            for fmt in REFS:
                (qref, dref), (qk, dk) = REFS[fmt], KERNELS[fmt]
                codes, scales = qk(x)
                ok = all(torch.equal(t, r) for t, r in zip((codes, scales), qref(x)))
                ok &= torch.equal(dk(codes, scales, torch.bfloat16).view(torch.int16),
                                  dref(codes, scales, torch.bfloat16).view(torch.int16))
                nbytes = x.numel() * 2 + codes.numel() + scales.numel()
                for fn, args in ((qk, (x,)), (lambda c, s: dk(c, s, torch.bfloat16), (codes, scales))):
                    pct = 100 * nbytes / (bench(lambda: fn(*args)) * 1e-3) / 1e9 / copy_gbs
                    cells.append(f"{pct:.0f}%" + ("" if ok else " WRONG"))
            print(f"| {threads} | {unroll} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
