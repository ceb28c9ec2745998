"""Cold start to the first token: an exported artifact (load, no compile) against dsv41c.compile
(load the weights, compile, run) and eager (load the weights, run), each in a fresh Python process.

The time is measured from the process's start (before `import torch`) to the first generated token
(the prefill's argmax), so it counts imports, weights, loading or compiling, and the prefill. The
compile is measured twice: with an empty Inductor cache (a new machine) and with the cache the first
run left (a restart on the same machine).

    python benchmarks/cold_start.py --config configs/tiny.json --artifact DIR [--prompt-len 24]
    python benchmarks/cold_start.py --config configs/bench.json --device cuda --dtype bfloat16

Weights: by default every path reads them from disk, as a deployment does: the seed-0 model of
--config is written once as a checkpoint (`save_checkpoint`, not timed), the export exports it, and
the compile and eager paths load it (`load_model`). With --weights random the compile and eager
paths draw the random weights in the process instead (`build_model`, seed 0; on a large config that
is minutes of host RNG, which no deployment pays). Without --artifact, the model is exported first
into a temp directory (minutes on a CPU core), for --device with --dtype (the artifact given must
match them and hold the seed-0 weights of --config). On CPU each process runs one thread.
--workdir keeps the checkpoint, the artifact, the Inductor cache and each finished row, so that a
run stopped part way (a large config needs about 25 minutes on an H200) goes on where it stopped.
--paths picks some of the paths (artifact, compile, eager), so that a large config's paths can run
on two GPUs of one host at once; without the artifact path nothing is exported. --passes and
--kv-quant set the pass pipeline and the KV numerics of both the export and the compile (eager runs
with the same --kv-quant), so the artifact and the compile run the same program.

Each row records its first token and the gap between its two largest logits ("margin"), so that
tokens which differ can be told apart from a near tie, and each path's first-token logits are
compared with eager's (relative max-abs); a bf16 run also runs the same weights eagerly in fp32 (a
reference path, not timed) and compares every path with it, which tells rounding from a program
that computes something else; the artifact's row also records where its
load went (`Artifact.load_seconds`: the hashes, the weights, each package). A path that is not what
it says (the compile path compiled no graph, the artifact or eager path compiled one) stops the run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv41c.compiler import DEFAULT_PASSES

PATHS = ("artifact", "compile", "eager")

CHILD = r"""
import time, sys, json
t0 = time.perf_counter()
import torch
import dsv41c
mode, config, artifact, n, device, dtype, passes, kv_quant, checkpoint, logits_file = sys.argv[1:11]
n, passes, kv_quant = int(n), tuple(p for p in passes.split(",") if p), kv_quant == "1"
if device == "cpu":
    torch.set_num_threads(1)
ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
t_import = time.perf_counter()
if mode == "artifact":
    model = dsv41c.load_artifact(artifact)
elif checkpoint:
    model = dsv41c.load_model(checkpoint, dtype=getattr(torch, dtype), kv_quant=kv_quant, device=device)
else:
    model = dsv41c.build_model(dsv41c.ModelArgs.from_json(config), seed=0, dtype=getattr(torch, dtype),
                               device=device, kv_quant=kv_quant)
if mode == "compile":
    model = dsv41c.compile(model, passes)
t_ready = time.perf_counter()
logits = model(ids, 0).float()
token = int(logits.argmax(-1))               # reads the token back: the device has finished
t_first = time.perf_counter()
top2 = logits.flatten().topk(2).values.tolist()
torch.save(logits.cpu(), logits_file)
print(json.dumps({"import": t_import - t0, "ready": t_ready - t_import, "first": t_first - t_ready,
                  "total": t_first - t0, "token": token, "margin": top2[0] - top2[1],
                  "load": getattr(model, "load_seconds", None),
                  "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
"""


# The checkpoint of the seed-0 model (argv: config, dtype, out), built on the CPU.
SAVE = r"""
import sys, torch, dsv41c
config, dtype, out = sys.argv[1:4]
dsv41c.save_checkpoint(dsv41c.build_model(dsv41c.ModelArgs.from_json(config), seed=0, dtype=getattr(torch, dtype)), out)
"""


REFERENCE = "eager, float32 (reference)"


def logits_file(tmp: str, name: str) -> Path:
    return Path(tmp) / ("logits-" + "".join(c if c.isalnum() else "-" for c in name) + ".pt")


def logit_errors(tmp: str, names: list[str]) -> dict[str, dict[str, float]]:
    """name -> {"eager" / the fp32 reference: relative max-abs error of its first-token logits}, for
    the paths whose logits are on disk (rows of an earlier run of the benchmark may have none)."""
    from dsv41c.golden import relative_error
    found = {n: torch.load(logits_file(tmp, n)) for n in names if logits_file(tmp, n).exists()}
    refs = [r for r in ("eager", REFERENCE) if r in found]
    return {n: {r: relative_error(found[n], found[r]) for r in refs if r != n} for n in found if n != REFERENCE}


def child(mode: str, opts: argparse.Namespace, artifact: str, checkpoint: str, env: dict, cwd: str,
          logits_out: Path, dtype: str | None = None) -> dict:
    """One path in a fresh process: its timings and first token, its logits saved to `logits_out`."""
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, opts.config, artifact, str(opts.prompt_len),
                           opts.device, dtype or opts.dtype, ",".join(opts.passes), str(int(opts.kv_quant)),
                           checkpoint, str(logits_out)],
                          capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode:
        sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    # each path is what it says: the compile path compiled its graphs, the others none
    if (row["graphs"] > 0) != (mode == "compile"):
        sys.exit(f"{mode} run: {row['graphs']} graphs compiled, expected {'some' if mode == 'compile' else 'none'}")
    return row


@contextlib.contextmanager
def workdir(opts: argparse.Namespace):
    """(directory, finished rows by name, where to save them or None): a temp directory, or --workdir
    with the rows of earlier runs with the same options (other options there are an error)."""
    if opts.workdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp, {}, None
        return
    root = Path(opts.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    key = {k: v for k, v in vars(opts).items() if k not in ("paths", "workdir")}
    saved = root / "options.json"
    if saved.exists() and json.loads(saved.read_text()) != key:
        sys.exit(f"--workdir {root}: holds a run with other options ({saved}); use another directory")
    saved.write_text(json.dumps(key, indent=1))
    rows_file = root / "rows.json"
    yield str(root), json.loads(rows_file.read_text()) if rows_file.exists() else {}, rows_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.json")
    parser.add_argument("--artifact", default=None, help="an export of --config with seed 0 (else one is made)")
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, of {', '.join(PATHS)} (default: all)")
    parser.add_argument("--passes", default=",".join(DEFAULT_PASSES),
                        help="comma-separated pass pipeline of the export and the compile (default: %(default)s)")
    parser.add_argument("--kv-quant", action=argparse.BooleanOptionalAction, default=False,
                        help="KV quantisation numerics (fp4_kv needs it)")
    parser.add_argument("--weights", choices=("checkpoint", "random"), default="checkpoint",
                        help="compile and eager paths: load a checkpoint of the seed-0 model (default) or draw "
                             "the random weights in the process")
    parser.add_argument("--workdir", default=None,
                        help="keep the checkpoint, the artifact, the Inductor cache and the finished rows here "
                             "(default: a temp directory); a rerun with the same options reuses what is done")
    opts = parser.parse_args()
    opts.passes = [p for p in opts.passes.split(",") if p]
    paths = [p for p in opts.paths.split(",") if p]
    if not paths or set(paths) - set(PATHS):
        parser.error(f"--paths: expected some of {', '.join(PATHS)}, found {opts.paths!r}")
    opts.config = str(Path(opts.config).resolve())
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if opts.device == "cpu" else dict(os.environ)
    # Every child runs in the temp directory: `python -c`/`-m` put the working directory first on
    # sys.path, and a source checkout there would shadow the installed dsv41c package.
    with workdir(opts) as (tmp, done, rows_file):
        artifact = opts.artifact and str(Path(opts.artifact).resolve())
        export = artifact is None and "artifact" in paths
        checkpoint = ""
        if opts.weights == "checkpoint" and (export or {"compile", "eager"} & set(paths)):
            checkpoint = str(Path(tmp) / "checkpoint")
            t0 = time.perf_counter()
            if not (Path(checkpoint) / "config.json").exists():  # (written last)
                subprocess.run([sys.executable, "-c", SAVE, opts.config, opts.dtype, checkpoint], check=True,
                               env=env, cwd=tmp)
                print(f"checkpoint of the seed-0 model written: {time.perf_counter() - t0:.0f} s", flush=True)
        if export:
            artifact = str(Path(tmp) / "artifact")
        if export and not Path(artifact).exists():  # (an export is complete or absent)
            t0 = time.perf_counter()
            source = ["--model", checkpoint] if checkpoint else ["--config", opts.config]
            subprocess.run([sys.executable, "-m", "dsv41c.cli.main", "export", *source,
                            "--out", artifact, "--device", opts.device, "--dtype", opts.dtype,
                            "--kv-quant" if opts.kv_quant else "--no-kv-quant",
                            *(a for name in opts.passes for a in ("--pass", name))], check=True, env=env, cwd=tmp)
            print(f"export: {time.perf_counter() - t0:.0f} s", flush=True)
        cache_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor-cache")}
        rows = {}
        for name, mode, child_env in (("artifact (load)", "artifact", env),
                                      ("dsv41c.compile, empty cache", "compile", cache_env),
                                      ("dsv41c.compile, warm cache", "compile", cache_env),
                                      ("eager", "eager", env)):
            if mode in paths:
                if name.endswith("empty cache") and name not in done:  # (a killed run may have left some)
                    shutil.rmtree(cache_env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
                earlier = name in done
                rows[name] = done[name] if earlier else child(mode, opts, artifact or "", checkpoint, child_env, tmp,
                                                              logits_file(tmp, name))
                done[name] = rows[name]
                if rows_file:  # each row as it finishes: a rerun after a kill goes on from here
                    rows_file.write_text(json.dumps(done, indent=1))
                print(f"{name}: {rows[name]}{' (an earlier run)' if earlier else ''}", flush=True)
        # The accuracy of each path's first-token logits: against eager in the same dtype, and for a
        # bf16 run against the same weights run eagerly in fp32 (not timed, not in the table).
        if opts.dtype != "float32" and "eager" in paths and REFERENCE not in done:
            try:   # (the fp32 model is twice the bf16 one: on a small device it may not fit)
                done[REFERENCE] = child("eager", opts, "", checkpoint, env, tmp, logits_file(tmp, REFERENCE),
                                        "float32")
            except SystemExit as e:
                print(f"{REFERENCE}: failed, so no comparison with fp32 ({str(e).splitlines()[-1]})", flush=True)
            if rows_file:
                rows_file.write_text(json.dumps(done, indent=1))
        errors = logit_errors(tmp, list(rows) + ([REFERENCE] if REFERENCE in done else []))
    tokens = {r["token"] for r in rows.values()}
    base = rows["artifact (load)"]["total"] if "artifact (load)" in rows else None
    threads = ", 1 thread" if opts.device == "cpu" else ""
    agree = "agree" if len(tokens) == 1 else f"DIFFER: {tokens}"
    weights = "from a checkpoint" if checkpoint else "random in the process (compile, eager)"
    print(f"cold start to the first token, {opts.config} on {opts.device} ({opts.dtype}, kv_quant={opts.kv_quant}, "
          f"passes {','.join(opts.passes) or 'none'}), prompt of {opts.prompt_len} tokens{threads}, fresh process "
          f"each, weights {weights}; first tokens {agree}")
    print(f"| {'path':<28} | import s | load/build+compile s | prefill s | total s | x artifact |")
    print(f"|{'-' * 30}|---------:|---------------------:|----------:|--------:|-----------:|")
    for name, r in rows.items():
        ratio = f"{r['total'] / base:10.2f}" if base else f"{'-':>10}"
        print(f"| {name:<28} | {r['import']:8.2f} | {r['ready']:20.2f} | {r['first']:9.2f} | {r['total']:7.2f} "
              f"| {ratio} |")
    for name, r in rows.items():
        if r.get("load"):
            print(f"{name}, its load: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["load"].items()))
    print("first tokens (logit margin): " + ", ".join(f"{name} {r['token']} ({r.get('margin', float('nan')):.3f})"
                                                      for name, r in rows.items()))
    if REFERENCE in done:
        print(f"{REFERENCE}: first token {done[REFERENCE]['token']} (margin {done[REFERENCE]['margin']:.3f})")
    for name, errs in errors.items():
        print(f"{name}, its first-token logits (relative max-abs): "
              + ", ".join(f"{e:.4f} from {ref}" for ref, e in errs.items()))


if __name__ == "__main__":
    main()
