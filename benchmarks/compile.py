"""The whole model three ways, side by side in one run: eager, plain `torch.compile` (Inductor, no
freezing, no passes) and `dsv41c.compile` (Inductor with frozen weights and the pass pipeline).
Both compiled variants get dsv41c's `INDUCTOR_WORKAROUNDS` (settings that avoid Inductor bugs).
A workload that fails to compile or run is recorded with its error and the run goes on.

Measures prefill tokens/s at one length (batch 1) and decode tokens/s at each batch size. A first
pass over every workload compiles every graph the timed passes use (its time is reported
separately); the timed passes follow. With `--parallel` each variant runs in its own process: the
compiles, which are host-bound, overlap, and the timed passes run one variant at a time once every
compile has finished, so no compile competes with a measurement. A first pass that runs out of
device memory beside its siblings' models is run again, alone, at the start of its timing phase. The
ceilings come from the same run: the device copy bandwidth against the weight bytes a decode step
reads, and the matmul rate against the prefill's projection FLOPs (2 x active parameters x tokens;
attention excluded, so it is a lower bound on the work).

    python benchmarks/compile.py --config configs/bench.json --device cuda --dtype bfloat16
    python benchmarks/compile.py --config configs/bench.json --parallel --variants eager,torch.compile,dsv41c.compile,dsv41c.compile+lower_mhc
    python benchmarks/compile.py --config configs/tiny.json --device cpu     # minutes: CPU compiles

On CPU, whole-model Inductor compiles take minutes per graph; decode compiles one graph per batch
class (batch 1 against batch > 1).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import functools
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import dsv41c
from dsv41c.compiler import DEFAULT_PASSES, INDUCTOR_WORKAROUNDS
from dsv41c.model import Transformer

VARIANTS = ("eager", "torch.compile", "dsv41c.compile")
# "dsv41c.compile+lower_mhc+fp4_kv": the default pass pipeline plus the named passes; "+cpp_wrapper"
# (not a pass) compiles with Inductor's C++ wrapper, "+cudagraphs" replays the decode steps' CUDA
# graphs (dsv41c.compile's options of those names)
CPP_WRAPPER, CUDAGRAPHS = "cpp_wrapper", "cudagraphs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    n = (1 << 30 if device == "cuda" else 1 << 26) // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, 5)


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of one square matmul in the model dtype (TF32 stays off, as in the model's fp32 runs)."""
    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    return 2 * n ** 3 / timed(lambda: a @ b, device, 5)


def weight_bytes(model: Transformer, batch: int) -> tuple[int, int]:
    """(bytes a decode step of `batch` rows reads from weights, parameters active per token).

    Routed experts count min(E, batch x k) experts per MoE (the distinct experts touched at most);
    the DSpark stages do not run in these steps and are left out.
    """
    read = active = 0
    for name, t in model.named_parameters():
        if name.startswith(("mtp.", "embed.")):
            continue
        nbytes, numel = t.numel() * t.element_size(), t.numel()
        if ".ffn.experts." in name:
            moe = model.layers[int(name.split(".")[1])].ffn
            k, e = moe.gate.topk, moe.n_experts
            read += nbytes * min(e, batch * k) // e
            active += numel * k // e
        else:
            read += nbytes
            active += numel
    return read, active


def make_variant(name: str, model: Transformer):
    if name == "eager":
        return model
    if name.startswith("dsv41c.compile"):
        suffixes = name.split("+")[1:]
        extra = tuple(p for p in suffixes if p not in (CPP_WRAPPER, CUDAGRAPHS))
        return dsv41c.compile(model, passes=DEFAULT_PASSES + extra, cpp_wrapper=CPP_WRAPPER in suffixes,
                              cudagraphs=CUDAGRAPHS in suffixes)
    fn = torch.compile(model.forward, fullgraph=True, dynamic=True)

    def plain(ids, start_pos=0, full_logits=False):   # Inductor's defaults but for dsv41c.compile's workarounds
        with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                                          specialize_float=True), \
                torch._inductor.config.patch(INDUCTOR_WORKAROUNDS):
            return fn(ids, start_pos, full_logits)
    return plain


def measure(name: str, model: Transformer, a: argparse.Namespace, gen: torch.Generator, out: dict,
            save=lambda: None, timing=contextlib.nullcontext) -> None:
    """Prefill and decode rates of one variant into `out`.

    Two phases: a first pass over every workload (it compiles; its time is reported), then, inside
    the `timing()` context, the copy bandwidth and matmul rate (`out["hardware"]`: measured while no
    sibling compiles or builds a model on the device) and the timed passes. Results are printed and
    saved as they come."""
    torch._dynamo.reset()
    run = make_variant(name, model)
    vocab = model.args.vocab_size
    out["first_pass_s"] = 0.0
    workloads = []                              # (key, seed before each timed pass, the timed pass, tokens)

    def failed(key: str, err: Exception) -> None:        # record it and go on with the next workload
        msg = str(err).strip()
        out[key] = None
        out[f"{key}_error"] = f"{type(err).__name__}: {msg.splitlines()[0][:300] if msg else ''}"
        out[f"{key}_error_detail"] = msg[:20000]     # a C++ compile error's first line names no cause
        print(f"  {name}: {key} FAILED: {out[f'{key}_error']}", flush=True)
        for line in [ln for ln in msg.splitlines()[1:] if "error" in ln.lower()][:20]:
            print(f"    {line[:400]}", flush=True)
        save()
    if a.prefill_len:
        ids = torch.randint(0, vocab, (1, a.prefill_len), generator=gen).to(a.device)
        workloads.append(("prefill_tok_s", model.reset_cache, lambda: run(ids, 0), a.prefill_len))
    for batch in a.batches:
        prompt = torch.randint(0, vocab, (batch, a.decode_prompt), generator=gen).to(a.device)
        steps = torch.randint(0, vocab, (batch, a.decode_steps, 1), generator=gen).to(a.device)

        def decode(steps=steps, start=a.decode_prompt):
            for i in range(a.decode_steps):
                run(steps[:, i], start + i)

        def seed(prompt=prompt):               # eager prefill: only the decode steps are timed
            model.reset_cache()
            model(prompt, 0)
        workloads.append((f"decode_b{batch}_tok_s", seed, decode, batch * a.decode_steps))
        if a.long_context:
            # a 64K prefill does not fit (its indexer scores alone are 64K x 64K per head)
            workloads.append((f"decode_b{batch}_ctx{a.long_context}_tok_s",
                              lambda: model.cache.fill_synthetic(a.seed, vocab),
                              functools.partial(decode, start=a.long_context), batch * a.decode_steps))

    ready, retry = [], []

    def first_pass(key, seed, fn, alone: bool) -> None:
        try:
            seed()
            sync(a.device)
            t0 = time.perf_counter()
            fn()
            sync(a.device)
            out[f"{key}_first_pass_s"] = first = time.perf_counter() - t0
            out["first_pass_s"] += first
            print(f"  {name}: {key} compiled and ran once ({first:.0f} s)", flush=True)
            ready.append(key)
            save()
        except torch.OutOfMemoryError as err:
            if alone:
                failed(key, err)
                return
            # --parallel's siblings hold the device's memory while they compile: once more, alone
            print(f"  {name}: {key} ran out of device memory beside its siblings; retried alone", flush=True)
            retry.append(key)
        except Exception as err:                            # noqa: BLE001 - a compiler failure is a result
            failed(key, err)
        finally:
            release_cached_memory(a.device)

    for key, seed, fn, _ in workloads:          # phase 1: compile
        first_pass(key, seed, fn, alone=a.sync_dir is None)
    with timing():                              # phase 2: measure
        for key, seed, fn, _ in workloads:
            if key in retry:
                first_pass(key, seed, fn, alone=True)
        out["hardware"] = hardware(a)
        save()
        for key, seed, fn, tokens in workloads:
            if key not in ready:
                continue
            try:
                times = []
                for _ in range(a.repeats):
                    seed()
                    times.append(timed(fn, a.device, 1))
                out[key] = tokens / sorted(times)[len(times) // 2]
                print(f"  {name}: {key} {out[key]:.1f}", flush=True)
                save()
            except Exception as err:                        # noqa: BLE001
                failed(key, err)
        if a.profile:                           # after the timings: the profiler's overhead is not in them
            for key, seed, fn, _ in workloads:
                if key.startswith("decode") and out.get(key):
                    seed()
                    out[f"{key}_profile"] = profile_steps(fn, a.device, a.decode_steps)
                    print(f"  {name}: {key} profile {out[f'{key}_profile']}", flush=True)
                    save()
        release_cached_memory(a.device)          # before the lock goes to a sibling
    torch._dynamo.reset()


def release_cached_memory(device: str) -> None:
    """Give the allocator's cached free blocks back to the device, for `--parallel`'s siblings."""
    if device == "cuda":
        torch.cuda.empty_cache()


def profile_steps(fn, device: str, steps: int, top: int = 6) -> dict:
    """One run of `fn` (`steps` decode steps) under torch.profiler, per step: device kernels, their
    summed device time, the host time (inflated by the profiler), the ops with the most host time and
    the kernels and the ops (with what they launch) with the most device time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        host = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)
    busiest = sorted(kernels, key=lambda e: -e.self_device_time_total)
    # device time by the op that launched it (TileLang kernels are all named main_kernel)
    by_op = sorted((e for e in cpu if not e.key.startswith(("##", "cu", "Command"))),
                   key=lambda e: -e.device_time_total)
    return {"kernels_per_step": sum(e.count for e in kernels) / steps,
            "device_us_per_step": sum(e.self_device_time_total for e in kernels) / steps,
            "host_us_per_step_profiled": host * 1e6 / steps,
            "top_host_ops_us_per_step": [[e.key, round(e.self_cpu_time_total / steps, 1)] for e in cpu[:top]],
            "top_kernels_us_per_step": [[e.key[:80], e.count / steps, round(e.self_device_time_total / steps, 1)]
                                        for e in busiest[:2 * top]],
            "top_ops_device_us_per_step": [[e.key[:80], e.count / steps, round(e.device_time_total / steps, 1)]
                                           for e in by_op[:3 * top]]}


def file_stem(variant: str) -> str:
    """A variant's name as a plain file name ("dsv41c.compile+cudagraphs" ->
    "dsv41c.compile_cudagraphs"): some file transfers drop names with other characters."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in variant)


@contextlib.contextmanager
def sibling_timing(sync_dir: Path, variant: str, lock: Path):
    """The timing phase of one of `--parallel`'s children: say this child has compiled, wait for the
    parent's go (every living sibling has compiled too, so no compile competes for the host), then
    time under an exclusive lock (one sibling at a time on the device)."""
    (sync_dir / f"ready.{file_stem(variant)}").touch()
    while not (sync_dir / "go").exists():
        time.sleep(1)
    with device_lock(lock):
        yield


def lock_file(a: argparse.Namespace) -> Path | None:
    """The lock the timed passes hold: --device-lock, else (a --parallel child) its group's."""
    return a.device_lock or (a.sync_dir / "lock" if a.sync_dir else None)


@contextlib.contextmanager
def device_lock(path: Path | None):
    """Hold an exclusive lock on `path` (no lock for None)."""
    if path is None:
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_parallel(a: argparse.Namespace, argv: list[str]) -> dict:
    """One child process per compiled variant, compiling at the same time; once every living child
    has compiled, the parent lets them time one after another. Eager needs no compile: the parent
    measures it itself after the children have exited (so the device holds one model copy fewer
    while they compile), with the ceilings. Returns the merged record."""
    compiled = [v for v in a.variants if v != "eager"]
    # with --json, the children's records stay beside it (OUT.parts/), else in a temporary folder
    parts = a.json.with_name(a.json.name + ".parts") if a.json else None
    with contextlib.nullcontext(parts) if parts else tempfile.TemporaryDirectory(prefix="dsv41c-bench-") as tmp:
        sync_dir = Path(tmp)
        if parts:
            shutil.rmtree(parts, ignore_errors=True)
            parts.mkdir(parents=True)
        base = strip_options([x for x in argv if x != "--parallel"], ("--variants", "--json"))
        children = {v: subprocess.Popen([sys.executable, __file__, *base, "--variants", v,
                                         "--json", str(sync_dir / f"{file_stem(v)}.json"), "--sync-dir", str(sync_dir)])
                    for v in compiled}
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a timeout: keep what was measured
        stopped = False
        try:
            while any(p.poll() is None for p in children.values()):
                alive = [v for v, p in children.items() if p.poll() is None]
                if all((sync_dir / f"ready.{file_stem(v)}").exists() for v in alive):
                    (sync_dir / "go").touch()
                time.sleep(1)
        except (SystemExit, KeyboardInterrupt):
            stopped = True
            print("stopped: ending the children; the table has what they measured", flush=True)
        finally:
            for p in children.values():
                if p.poll() is None:
                    p.terminate()
                    p.wait()
        records = {v: json.loads((sync_dir / f"{file_stem(v)}.json").read_text())
                   for v in compiled if (sync_dir / f"{file_stem(v)}.json").exists()}
    if "eager" in a.variants and not stopped:
        record = run_variants(argparse.Namespace(**{**vars(a), "variants": ["eager"]}))
        records["eager"] = record
    elif records:
        record = dict(next(iter(records.values())))
    else:
        sys.exit("every child failed before recording anything")
    record["rows"] = [records[v]["rows"][0] if v in records else
                      {"variant": v, "error": "nothing recorded (stopped, or failed early: see the log)"}
                      for v in a.variants]
    if "decode_weight_bytes" in record:    # (else every child failed before building its model)
        set_ceilings(record, a)
    record["parallel"] = True
    return record


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` without the named options and their values (`--x v` and `--x=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{n}=" for n in names)):
            out.append(arg)
    return out


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path("configs/tiny.json"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kv-quant", action=argparse.BooleanOptionalAction, default=True,
                   help="the official KV fake-quantisation numerics (default on, as `dsv41c run`)")
    p.add_argument("--prefill-len", type=int, default=None, help="default: 4096 on cuda, 32 on cpu; 0 skips")
    p.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    p.add_argument("--decode-prompt", type=int, default=None,
                   help="tokens in the cache before the timed decode steps; default: 3 x window + 1")
    p.add_argument("--decode-steps", type=int, default=None, help="default: 32 on cuda, 4 on cpu")
    p.add_argument("--profile", action="store_true",
                   help="after the timings, one profiled run of each decode workload: kernels and device "
                        "time per step, the host ops that take the most time")
    p.add_argument("--long-context", type=int, default=0, metavar="N",
                   help="also time the decode steps from position N, on caches filled with synthetic values "
                        "(no prefill; max_seq_len is raised to fit); the compiled decode graph is the same")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (median); default 5 cuda, 2 cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results as JSON")
    p.add_argument("--parallel", action="store_true",
                   help="one process per variant: the compiles overlap (they are host-bound), the timed "
                        "passes run one variant at a time after every compile has finished")
    p.add_argument("--device-lock", type=Path, default=None, metavar="FILE",
                   help="a lock file shared with other runs on the same device: timed passes hold it")
    p.add_argument("--sync-dir", type=Path, default=None, help=argparse.SUPPRESS)   # --parallel's children
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    a.prefill_len = (4096 if gpu else 32) if a.prefill_len is None else a.prefill_len
    a.decode_steps = a.decode_steps or (32 if gpu else 4)
    a.repeats = a.repeats or (5 if gpu else 2)
    a.batches = [int(b) for b in a.batches.split(",") if b]
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(v for v in a.variants if v not in VARIANTS and not v.startswith("dsv41c.compile+"))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {VARIANTS} or dsv41c.compile+<pass>+...")
    return a


def main() -> None:
    a = parse()
    record = run_parallel(a, sys.argv[1:]) if a.parallel else run_variants(a)
    if a.json:
        write_json(a.json, record)
    print_table(record, a.variants)


def run_variants(a: argparse.Namespace) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    args = dsv41c.ModelArgs.from_json(a.config)
    a.decode_prompt = a.decode_prompt or 3 * args.window_size + 1
    # One token of headroom: at batch > 1 a decode step at the last position of max_seq_len reads
    # every row of a compressed cache, a contiguous view where every earlier step's is not, and a
    # compiled graph guards on that (README, `dsv41c.compile`): the timed steps stay clear of it.
    need = max(a.prefill_len, max(a.decode_prompt, a.long_context) + a.decode_steps) + 1
    args = args.replace(max_batch_size=max([args.max_batch_size, *a.batches]),
                        max_seq_len=max(args.max_seq_len, need))
    model = dsv41c.build_model(args, seed=a.seed, dtype=DTYPES[a.dtype], kv_quant=a.kv_quant, device=a.device)
    gen = torch.Generator().manual_seed(a.seed)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{a.config} on {device_name}, {a.dtype}, kv_quant={a.kv_quant}, torch {torch.__version__}", flush=True)
    record = {"config": str(a.config), "device": device_name, "dtype": a.dtype, "kv_quant": a.kv_quant,
              "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "active_params": weight_bytes(model, 1)[1],
              "decode_weight_bytes": {str(b): weight_bytes(model, b)[0] for b in a.batches},
              "prefill_len": a.prefill_len, "decode_prompt": a.decode_prompt, "decode_steps": a.decode_steps,
              "long_context": a.long_context,
              "batches": a.batches, "rows": []}

    def save() -> None:  # after every workload, so a run cut short keeps what it measured
        if a.json:
            write_json(a.json, record)

    for name in a.variants:
        record["rows"].append({"variant": name})
        timing = (functools.partial(sibling_timing, a.sync_dir, name, lock_file(a)) if a.sync_dir else
                  functools.partial(device_lock, lock_file(a)))
        measure(name, model, a, gen, record["rows"][-1], save, timing)
        print(f"  {name}: done ({record['rows'][-1]['first_pass_s']:.0f} s first pass, compiles included)",
              flush=True)
    set_ceilings(record, a)
    return record


def hardware(a: argparse.Namespace) -> dict:
    """The device's copy bandwidth and matmul rate, measured now (callers hold the device lock)."""
    hw = {"copy_bytes_per_s": copy_bandwidth(a.device), "matmul_flop_per_s": matmul_rate(a.device, DTYPES[a.dtype])}
    print(f"  copy {hw['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul {hw['matmul_flop_per_s'] / 1e12:.2f} TFLOP/s",
          flush=True)
    return hw


def set_ceilings(record: dict, a: argparse.Namespace) -> None:
    """The record's ceilings from the best copy bandwidth and matmul rate its variants measured in
    their timing phases (each is a measurement of the same device; the best is the least disturbed);
    measured here if no variant got that far."""
    measured = [r["hardware"] for r in record["rows"] if r.get("hardware")]
    if not measured:
        with device_lock(lock_file(a)):
            measured = [hardware(a)]
    copy_bps = max(h["copy_bytes_per_s"] for h in measured)
    flops = max(h["matmul_flop_per_s"] for h in measured)
    ceilings = {}
    if a.prefill_len:
        ceilings["prefill_tok_s"] = flops / (2 * record["active_params"])
    for b in a.batches:
        ceilings[f"decode_b{b}_tok_s"] = b * copy_bps / record["decode_weight_bytes"][str(b)]
        if a.long_context:      # the same weight-only bound: the KV bytes a step reads are not counted
            ceilings[f"decode_b{b}_ctx{a.long_context}_tok_s"] = ceilings[f"decode_b{b}_tok_s"]
    record.update(copy_bytes_per_s=copy_bps, matmul_flop_per_s=flops, ceilings_tok_s=ceilings)


def write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=lambda x: None if math.isnan(x) else x) + "\n")
    tmp.replace(path)


def workload_label(key: str, record: dict) -> str:
    """'prefill 4096', 'decode batch 32 at 385' (the position of the first timed step)."""
    if key == "prefill_tok_s":
        return f"prefill {record['prefill_len']}"
    batch, _, context = key.removeprefix("decode_b").removesuffix("_tok_s").partition("_ctx")
    return f"decode batch {batch} at {context or record['decode_prompt']}"


def print_table(record: dict, variants: list[str]) -> None:
    rows = record["rows"]
    ceilings = record["ceilings_tok_s"]
    base = {r["variant"]: r for r in rows}
    header = ["workload", *(f"{v} tok/s" for v in variants)]
    header += [f"{v} x eager" for v in variants if v != "eager" and "eager" in base]
    if {"torch.compile", "dsv41c.compile"} <= set(base):
        header.append("dsv41c x torch.compile")
    header.append("ceiling tok/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in ceilings:
        label = workload_label(key, record)

        def rate(v, key=key):
            return base[v].get(key)

        def ratio(v, w):
            return f"{rate(v) / rate(w):.2f}" if rate(v) and rate(w) else "-"
        cells = [label, *(f"{rate(v):.1f}" if rate(v) else "failed" for v in variants)]
        cells += [ratio(v, "eager") for v in variants if v != "eager" and "eager" in base]
        if {"torch.compile", "dsv41c.compile"} <= set(base):
            cells.append(ratio("dsv41c.compile", "torch.compile"))
        cells.append(f"{ceilings[key]:.3g}")
        print("| " + " | ".join(cells) + " |")
    print("first pass (compiles, s): " + ", ".join(f"{r['variant']} {r.get('first_pass_s', float('nan')):.0f}"
                                                   for r in rows))
    print("ceilings: prefill = matmul rate / (2 x active parameters); decode = copy bandwidth x batch / "
          "weight bytes a step reads (dense weights + min(E, batch x k) experts per MoE; KV reads not counted)")
    if record.get("long_context"):
        print(f"(decode at {record['long_context']}: caches filled with synthetic values, no prefill)")
    if record.get("parallel"):
        print("(--parallel: one process per compiled variant; compiles overlapped, timed passes one variant "
              "at a time after all compiles; eager measured after the children exited)")
    print(f"(ceilings from the best of the variants' copy and matmul measurements, each taken at the start of "
          f"its timed passes: {record['copy_bytes_per_s'] / 1e9:.0f} GB/s, {record['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s)")


if __name__ == "__main__":
    main()
