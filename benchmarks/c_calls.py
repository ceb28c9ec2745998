"""A compiled CPU decode step with every kernel pass, its TileLang C builds called three ways, side
by side in one process: through `CCall` (the launcher's direct call of the build's library, what
the ops use), through TileLang's own Cython adapter (`JITKernel.__call__`), and through `CCall` of
the same kernels built by TileLang's own compiler command, which has no optimisation flag (the
builds in use add `quant.C_FLAGS`).

    python3 benchmarks/c_calls.py [--config configs/tiny.json] [--rounds 6] [--steps 8]

The model (random weights, bf16, kv_quant; the indexer kernels take bf16 only) is compiled with
fuse_wqa_wkv, lower_mhc, fp4_kv, lower_sparse_attn and lower_indexer (not strict: tiny's candidate
blocks of 4 stay eager, the indexer kernels take blocks of 8) on the passes_only backend: the
rewritten aten graph runs as an FX module, so the kernels and their calls are the only thing the ways
change (Inductor's code generation would take many minutes on a CPU and changes nothing about
them). After a 40-token prefill and four decode steps, the rounds alternate the three ways,
one 40-token prefill and `--steps` decode steps each; printed: kernel calls per decode step and the
median prefill and step times of each way, in ms.
"""

import argparse
import statistics
import time
from pathlib import Path

import tilelang
import torch

import dsv41c
from dsv41c.tilelang_kernels import quant as K

PASSES = ("fuse_wqa_wkv", "lower_mhc", "fp4_kv", "lower_sparse_attn", "lower_indexer")
_UNOPTIMISED: dict[int, K.CCall] = {}


def unoptimised(launcher: K.Launcher) -> K.CCall:
    """The launcher's kernel built again without compiler flags, called through `CCall` (once per
    launcher)."""
    key = id(launcher)
    if key not in _UNOPTIMISED:
        _UNOPTIMISED[key] = K.CCall(tilelang.compile(launcher.kernel.prim_func, target="c").adapter)
    return _UNOPTIMISED[key]


WAYS = {"CCall (direct)": lambda launcher, *args: launcher.call(*args),
        "TileLang's Cython adapter": lambda launcher, *args: launcher.kernel(*args),
        "CCall, built without C_FLAGS": lambda launcher, *args: unoptimised(launcher)(*args)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path(__file__).parent.parent / "configs" / "tiny.json")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(1)
    args = dsv41c.ModelArgs.from_json(a.config)
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True)
    compiled = dsv41c.compile(model, PASSES, backend="passes_only")
    prompt = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([[5]])
    if 40 + 6 + len(WAYS) * a.rounds * a.steps > args.max_seq_len:
        raise SystemExit(f"--rounds x --steps reach past max_seq_len {args.max_seq_len}")
    direct = K.Launcher.__call__
    calls = []
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            compiled(prompt, 0)
            for pos in range(40, 44):
                compiled(token, pos)
            print(f"compiles, prefill and 4 decode steps: {time.perf_counter() - t0:.1f} s", flush=True)
            K.Launcher.__call__ = lambda launcher, *args: calls.append(1) or launcher.call(*args)
            compiled(token, 44)
            K.Launcher.__call__ = WAYS["CCall, built without C_FLAGS"]
            compiled(prompt, 0)                                   # builds them, untimed
            compiled(token, 45)
            times = {way: [] for way in WAYS}
            prefills = {way: [] for way in WAYS}
            pos = 46
            for _ in range(a.rounds):
                for way, call in WAYS.items():
                    K.Launcher.__call__ = call
                    t0 = time.perf_counter()
                    compiled(prompt, 0)    # the prompt again (timing only: later steps read its rows)
                    prefills[way].append((time.perf_counter() - t0) * 1e3)
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        compiled(token, pos)
                        pos += 1
                    times[way].append((time.perf_counter() - t0) / a.steps * 1e3)
    finally:
        K.Launcher.__call__ = direct
    print(f"{a.config.name}, passes {', '.join(PASSES)} (passes_only), torch {torch.__version__}, one thread")
    print(f"kernel calls per decode step: {len(calls)}; pass matches (all graphs): "
          + ", ".join(f"{s.name} {s.matches}" for s in compiled.pipeline.stats.values()))
    print("| C builds called through | 40-token prefill ms (median) | decode step ms (median) | min | max |")
    print("|---|---:|---:|---:|---:|")
    for way, v in times.items():
        print(f"| {way} | {statistics.median(prefills[way]):.1f} | {statistics.median(v):.2f} | {min(v):.2f} "
              f"| {max(v):.2f} |")


if __name__ == "__main__":
    main()
