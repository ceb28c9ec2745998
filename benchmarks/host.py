"""Host time per TileLang op call at decode shapes on the GPU: the launcher's direct call of the
TVM-FFI executable against TileLang's own call path, side by side in one run.

    python3 benchmarks/host.py [--calls 400] [--profile] [--json OUT.json]

A decode step is host-bound (BENCHMARKS.md, compiled model): each op's Python wrapper, TileLang's
call and the launches cost more than the kernels run. For each op this times, in microseconds per
call (wall clock of `--calls` back-to-back calls, then one synchronize; the kernels are shorter
than the host's part at these shapes, which the "device us" column shows):
  op, direct       the `dsv41c::` op as the compiled model calls it (tilelang_kernels/quant.Launcher
                   calls the executable)
  op, via TileLang the same op with every kernel called through TileLang's JITKernel and adapter
  kernels, direct / via TileLang   the op's kernel calls alone, replayed with its recorded arguments
  device us        the op's calls captured in a CUDA graph and replayed (the kernels alone)
and the floors: one small aten op (`add_` on one element) and one `torch.empty`.
--profile prints cProfile's top functions of the direct op calls.

Ops (bench.json dims): mHC `mhc_post_pre` and `mhc_pre` at one token (hc 4, dim 5120, bf16),
`sparse_attn_packed` at batch 32 (64 heads x 512, 128 window rows + top-512 of 4,096 compressed
rows), `fp8_quant` of 32 KV rows of 512.
"""

import argparse
import contextlib
import cProfile
import json
import pstats
import time

import torch
from attention import D as HEAD_DIM
from attention import decode_case
from dsv41c.tilelang_kernels import attention as A
from dsv41c.tilelang_kernels import mhc as M
from dsv41c.tilelang_kernels import quant as K
from mhc import HC, inputs
from quant import bench_graph  # benchmarks/ is the script's path


def wall_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@contextlib.contextmanager
def launcher_call(call):
    """Every launcher runs `call(launcher, *args)` meanwhile."""
    direct = K.Launcher.__call__
    K.Launcher.__call__ = call
    try:
        yield
    finally:
        K.Launcher.__call__ = direct


def recorded_calls(op):
    """The (launcher, args) of every kernel call one call of op makes."""
    calls, direct = [], K.Launcher.__call__

    def record(self, *args):
        calls.append((self, args))
        return direct(self, *args)
    with launcher_call(record):
        op()
    return calls


def ops():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = inputs(1, 4, 5120)
    post_pre = ("y", "res", "post", "comb", "pre_delayed", "fn", "scale", "base")
    yield "mhc_post_pre (1 token)", lambda: M.mhc_post_pre(*(x[k] for k in post_pre), **HC)
    h = x["res"]
    yield "mhc_pre (1 token)", lambda: M.mhc_pre(h, x["fn"], x["scale"], x["base"], x["pre_delayed"], **HC)
    q, ring, ring_scales, codes, scales, sink, idx = decode_case(32, 4096, 1, g)
    yield "sparse_attn_packed (batch 32)", lambda: A.sparse_attn_packed(q, ring, ring_scales, codes, scales, sink,
                                                                        idx[0], HEAD_DIM**-0.5)
    rows = torch.randn(32, 1, 512, device="cuda").bfloat16()
    yield "fp8_quant (32 rows)", lambda: torch.ops.dsv41c.fp8_quant(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    one = torch.zeros(1, device="cuda")
    floors = {"add_": wall_us(lambda: one.add_(1), a.calls),
              "empty": wall_us(lambda: torch.empty(1024, device="cuda"), a.calls)}
    rows = []
    for name, op in ops():
        calls = recorded_calls(op)  # (the first call builds the kernels)

        def kernels_direct(calls=calls):
            for launcher, args in calls:
                launcher.call(*args)

        def kernels_tilelang(calls=calls):
            for launcher, args in calls:
                launcher.kernel(*args)
        with launcher_call(lambda self, *args: self.kernel(*args)):  # through TileLang's JITKernel
            op_tilelang = wall_us(op, a.calls)
        row = {"op": name, "kernels": len(calls),
               "op_direct_us": wall_us(op, a.calls), "op_tilelang_us": op_tilelang,
               "kernels_direct_us": wall_us(kernels_direct, a.calls),
               "kernels_tilelang_us": wall_us(kernels_tilelang, a.calls),
               "device_us": bench_graph(op) * 1e3}
        rows.append(row)
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                op()
            prof.disable()
            print(f"\n{name}: cProfile of 200 direct op calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    print(f"\ndevice: {torch.cuda.get_device_name()}; {a.calls} calls per figure; floors: aten add_ "
          f"{floors['add_']:.1f} us, torch.empty {floors['empty']:.1f} us\n")
    print("| op | kernels | op, direct us | op, via TileLang us | saved us | kernels, direct us "
          "| kernels, via TileLang us | device us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['kernels']} | {r['op_direct_us']:.1f} | {r['op_tilelang_us']:.1f} | "
              f"{r['op_tilelang_us'] - r['op_direct_us']:.1f} | {r['kernels_direct_us']:.1f} | "
              f"{r['kernels_tilelang_us']:.1f} | {r['device_us']:.1f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "calls": a.calls, "floors_us": floors,
                       "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
