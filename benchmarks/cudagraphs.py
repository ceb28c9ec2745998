"""The decode step with and without `dsv41c.compile(cudagraphs=True)`, side by side in one run, on
tiny's first four layers at bench.json's widths (a cut that compiles in one to two minutes on an
H200 host; `benchmarks/compile.py --variants ...+cudagraphs` times the whole bench.json model).

    python3 benchmarks/cudagraphs.py [--batch 1] [--steps 24] [--then-batch N] [--graph-option KEY=VALUE ...]
                                     [--host-profile] [--json OUT.json]

Every pass, bf16, kv_quant; an eager prefill of 40 tokens, then `--steps` compiled decode steps on
the same tokens both ways. Prints, per variant: the first pass (compiles included), ms per step
(median of 3 passes), host-side launches per step by API (cuLaunchKernel: Triton and TileLang;
cudaLaunchKernel: aten; cudaGraphLaunch: one per graphed partition) and the device kernels per step
(torch.profiler over 4 steps), the relative max-abs distance of each step's logits from eager, and
the graphed variant's partitions (CUDA graph trees functions) and re-recordings (must stay none:
a partition that took the position would record again at every step). The compile without graphs
runs first; each graphed row also has, per step, its distance from it, the sequences more than
2e-2 apart and the sequences whose greedy token differs. Each row is printed, and --json written,
as soon as it is measured, so a run stopped early keeps what it measured. --then-batch N: the
graphed compile then decodes at batch N too (a fresh prompt, prefilled eagerly, and fresh tokens),
and the run reports the graphs compiled for it (none
expected when both batches are above 1: the batch is a symbol), the partitions recorded after it,
its re-recordings, its ms per step (second pass) and its distance from eager at each step.
--graph-option KEY=VALUE (repeatable): also a graphed variant, "cudagraphs+options", compiled with
these Inductor settings added to `dsv41c.compiler.CUDAGRAPH_OPTIONS` (VALUE a Python literal), to
time a setting before it goes into the defaults. --host-profile: also, per variant, where the
host's time goes (cProfile over 8 steps after the timings, the functions with the most own time per
step; cProfile slows Python down, so the shares matter, not the sums).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

import torch
from torch._inductor import cudagraph_trees

import dsv41c
from dsv41c import compiler
from dsv41c.golden import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import EVERY_PASS, first_four_args  # noqa: E402  (the cut and passes the GPU tests use)

PROMPT = 40
LAUNCH_APIS = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaGraphLaunch")


def distances(got, ref) -> list[float]:
    """Each step's relative max-abs distance of got's logits from ref's."""
    return [round(relative_error(x, y), 5) for x, y in zip(got, ref, strict=True)]


def graph_counts(manager) -> dict:
    """The CUDA graph trees' partitions (functions) and re-recordings so far."""
    return {"partitions_graphed": len(manager.ids_to_funcs),
            "rerecords": sum(n for per_node in manager.num_rerecord.values() for n in per_node.values())}


def host_profile(run, steps: int, top: int = 25) -> list[dict]:
    """cProfile of run() (which takes `steps` decode steps): the `top` functions by own time, with
    their calls and own and cumulative ms per step."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof).stats                         # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line} {name}", "calls_per_step": round(nc / steps, 1),
             "own_ms_per_step": round(tt / steps * 1e3, 3), "cumulative_ms_per_step": round(ct / steps * 1e3, 3)}
            for (file, line, name), (_, nc, tt, ct, _) in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--then-batch", type=int, default=None, metavar="N")
    ap.add_argument("--graph-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--host-profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in a.graph_option)}
    except (ValueError, SyntaxError) as e:
        sys.exit(f"cudagraphs.py: --graph-option {a.graph_option}: expected KEY=VALUE, VALUE a Python literal ({e})")
    if not torch.cuda.is_available():
        sys.exit("cudagraphs.py: needs a CUDA device")
    args = first_four_args("bench")
    model = dsv41c.build_model(args, seed=0, dtype=torch.bfloat16, kv_quant=True, device="cuda")
    if a.then_batch is not None and not 1 <= a.then_batch <= args.max_batch_size:
        sys.exit(f"cudagraphs.py: --then-batch {a.then_batch}: expected 1 .. {args.max_batch_size}")
    gen = torch.Generator().manual_seed(0)

    def inputs(batch):
        """A prompt and the decode steps' tokens, as separate tensors (a view's base sizes would be
        guarded on too)."""
        prompt = torch.randint(0, args.vocab_size, (batch, PROMPT), generator=gen).cuda()
        return prompt, [torch.randint(0, args.vocab_size, (batch, 1), generator=gen).cuda() for _ in range(a.steps)]

    prompt, tokens = inputs(a.batch)

    def decode(fn, keep=False, prompt_tokens=None):
        p, toks = prompt_tokens or (prompt, tokens)
        model.reset_cache()
        with torch.no_grad():
            model(p, 0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = [fn(t, PROMPT + i) for i, t in enumerate(toks)]
            torch.cuda.synchronize()
        return ([o.float() for o in out] if keep else None), (time.perf_counter() - t0) / len(toks) * 1e3

    def profiled_steps(fn) -> list[dict]:
        """host_profile of up to 8 decode steps of fn, after an eager prefill (not profiled)."""
        few = tokens[:8]

        def steps():
            for i, t in enumerate(few):
                fn(t, PROMPT + i)
            torch.cuda.synchronize()
        model.reset_cache()
        with torch.no_grad():
            model(prompt, 0)
            torch.cuda.synchronize()
            return host_profile(steps, len(few))

    def launches(fn) -> dict:
        from torch.profiler import ProfilerActivity, profile
        model.reset_cache()
        with torch.no_grad():
            model(prompt, 0)
            fn(tokens[0], PROMPT)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(1, 5):
                    fn(tokens[i], PROMPT + i)
                torch.cuda.synchronize()
        events = prof.key_averages()
        per_step = {e.key: e.count / 4 for e in events if e.key in LAUNCH_APIS}
        per_step["device kernels"] = sum(e.count for e in events if e.device_type != torch.autograd.DeviceType.CPU) / 4
        return per_step

    def then_batch(compiled, manager) -> dict:
        second = inputs(a.then_batch)
        ref, _ = decode(model, keep=True, prompt_tokens=second)
        graphs = compiled.graphs
        got, _ = decode(compiled, keep=True, prompt_tokens=second)
        return {"batch": a.then_batch, "graphs_compiled": compiled.graphs - graphs,
                **graph_counts(manager),
                "ms_per_step": decode(compiled, prompt_tokens=second)[1],
                "err_vs_eager": distances(got, ref)}

    eager, _ = decode(model, keep=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": a.batch,
              "steps": a.steps, "variants": {}}
    if options:
        record["graph_options"] = options
    logits = {}
    graphed = ["cudagraphs"] + ["cudagraphs+options"] * bool(options)
    defaults = dict(compiler.CUDAGRAPH_OPTIONS)
    # The plain compile first: the reference of the graphed rows, and a call stopped early still
    # has it. Each row is printed and the record written as soon as it is measured.
    for name in ("plain", *graphed):
        graphs = name != "plain"
        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
        compiler.CUDAGRAPH_OPTIONS = {**defaults, **options} if name == "cudagraphs+options" else defaults
        compiled = dsv41c.compile(model, EVERY_PASS, cudagraphs=graphs)
        t0 = time.perf_counter()
        logits[name], _ = decode(compiled, keep=True)
        row = {"first_pass_s": time.perf_counter() - t0,
               "ms_per_step": sorted(decode(compiled)[1] for _ in range(3))[1],
               "launches_per_step": launches(compiled),
               "err_vs_eager": distances(logits[name], eager)}
        if a.host_profile:
            row["host_profile"] = profiled_steps(compiled)
        if graphs:
            manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
            row.update(graph_counts(manager))
            if a.then_batch is not None:
                row["then_batch"] = then_batch(compiled, manager)
            compare_to_plain(row, logits[name], logits["plain"], record["variants"]["plain"]["ms_per_step"])
        record["variants"][name] = row
        print(name, json.dumps({k: x for k, x in row.items() if k != "host_profile"}), flush=True)
        for entry in row.get("host_profile", []):
            print(f"  {entry['own_ms_per_step']:8.3f} ms own {entry['cumulative_ms_per_step']:8.3f} ms cum "
                  f"{entry['calls_per_step']:7.1f} calls  {entry['function']}")
        if a.json:
            Path(a.json).write_text(json.dumps(record, indent=1))


def compare_to_plain(row: dict, got: list, plain: list, plain_ms: float) -> None:
    """Add to a graphed variant's row, per step: its distance from the plain compile, the sequences
    apart by more than 2e-2 of the step's logit scale, and those whose greedy token differs. The
    default graphed decode is the plain one's graph with RoPE's rows copied (on an H200:
    bit-identical at batch 1, within 1e-4 at batch 32); --graph-option settings may change more."""
    pairs = list(zip(got, plain, strict=True))
    row["vs_plain"] = distances(got, plain)
    row["sequences_apart"] = [int(((x - y).abs().amax(-1) > 2e-2 * y.abs().max()).sum()) for x, y in pairs]
    row["greedy_differs"] = [int((x.argmax(-1) != y.argmax(-1)).sum()) for x, y in pairs]
    row["speedup_vs_plain"] = plain_ms / row["ms_per_step"]


if __name__ == "__main__":
    main()
