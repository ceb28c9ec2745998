"""`dsv41c golden record` and `dsv41c golden check`: the golden regression files (DESIGN.md, Numerics)."""
from __future__ import annotations

import math
import time
from pathlib import Path
from contextlib import nullcontext
from typing import List, Optional

import torch
import typer
from rich import box
from rich.console import Console
from rich.table import Table

import dsv41c
from dsv41c import golden
from dsv41c.cli.compile import Backend
from dsv41c.config import default_config
from dsv41c.errors import GoldenMismatch, InputError

DEFAULT_CONFIGS = ("tiny.json", "tiny2.json")  # `default_config`
DEFAULT_DIR = Path("golden")

golden_app = typer.Typer(
    name="golden", no_args_is_help=True, add_completion=False,
    help="Record the eager model's outputs (fp32, kv_quant) and check later runs against them.")


def register(app: typer.Typer) -> None:
    app.add_typer(golden_app, name="golden")


@golden_app.command("record")
def record_command(
    configs: Optional[List[Path]] = typer.Option(
        None, "--config", metavar="PATH",
        show_default="configs/tiny.json and configs/tiny2.json in the current directory, else the installed copies",
        help="Model config JSON; repeat for several. Writes OUT/CONFIG-STEM.safetensors."),
    out: Path = typer.Option(DEFAULT_DIR, "--out", metavar="DIR", help="Directory of the golden files."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and of the prompt ids."),
    prompt_len: Optional[int] = typer.Option(
        None, "--prompt-len", metavar="N", show_default="3 × window_size + 1",
        help="Prompt tokens per batch row."),
    decode_steps: int = typer.Option(16, "--decode-steps", metavar="N", help="Greedy decode steps."),
    batch: int = typer.Option(2, "--batch", metavar="B", help="Batch rows."),
) -> None:
    """Record golden files and update OUT/manifest.json.

    The model is the eager float32 one without the KV fake quantisers (the reference a compiled
    program is held to), random weights from --seed; the file holds the prompt ids, the prefill
    logits, and the tokens and logits of greedy decoding.
    """
    configs = list(configs) if configs else [default_config(name) for name in DEFAULT_CONFIGS]
    for config in configs:
        if not config.is_file():
            raise InputError(f"--config {config}: expected a config file, found "
                             f"{'a directory' if config.is_dir() else 'nothing'}")
    stems = [c.stem for c in configs]
    if len(set(stems)) != len(stems):
        raise InputError(f"--config: two configs share a file name stem ({', '.join(stems)}); "
                         "their golden files would overwrite each other")
    console = Console(highlight=False)
    entries = {}
    for config in configs:
        started = time.perf_counter()
        path = golden.record(config, out, seed=seed, prompt_len=prompt_len, decode_steps=decode_steps, batch=batch)
        entries[path.name] = golden.manifest_entry(path, config)
        e = entries[path.name]
        console.print(f"recorded {path} ({path.stat().st_size:,} B, sha256 {e['sha256'][:12]}): {config}, "
                      f"batch {e['batch']}, prompt {e['prompt_len']}, {e['decode_steps']} decode steps, "
                      f"{time.perf_counter() - started:.1f} s", soft_wrap=True)
    console.print(f"updated {golden.write_manifest(out, entries)}")


@golden_app.command("check")
def check_command(
    directory: Path = typer.Option(DEFAULT_DIR, "--dir", metavar="DIR",
                                   help="Directory holding the golden files and manifest.json."),
    compiled: bool = typer.Option(False, "--compiled",
                                  help="Also run dsv41c.compile(model) and hold it to the eager replay."),
    backend: Backend = typer.Option(
        Backend.passes_only, "--backend",
        help="With --compiled: passes_only runs the rewritten post-grad graph without code generation "
             "(minutes on a CPU); inductor generates code (minutes per graph)."),
    steps: bool = typer.Option(False, "--steps", help="Show every decode step instead of the worst one."),
) -> None:
    """Check the eager (and compiled) model against the golden files.

    Replays every file of the manifest, feeding the recorded tokens back, and prints the worst error
    per output against its bound: eager vs golden 1e-5, compiled vs eager 1e-4, greedy tokens
    identical. Exits 2 on any failure, naming the first diverging token. --compiled compiles the
    prefill and the decode steps (a few graphs per file, recompiled per golden file).
    """
    compile_fn = getattr(dsv41c, "compile", None) if compiled else None
    if compiled and compile_fn is None:
        raise InputError("--compiled: compiler not available (this dsv41c has no dsv41c.compile); "
                         "run without --compiled to check the eager model")
    files = golden.golden_files(directory)
    reports, notes = [], []
    err = Console(stderr=True)
    for path in files:
        runner = model = None
        if compile_fn is not None:
            model = golden.load_golden(path).build_model()
            runner = compile_fn(model, backend=backend.value)
        what = f"checking {path}" + (f", compiling with backend {backend.value}" if runner else "")
        with err.status(what) if err.is_terminal else nullcontext():
            reports.append(golden.check(path, runner=runner, model=model, runner_name="compiled"))
        if runner is not None:
            notes.append(f"compiled {path.name}: dsv41c.compile backend {backend.value}, "
                         f"{getattr(runner, 'graphs', '?')} graphs, {getattr(runner, 'compile_seconds', 0.0):.0f} s "
                         "compiling")
    console = Console(highlight=False)
    console.print(report_table(reports, steps))
    for note in notes:
        console.print(note)
    for report in reports:
        recorded = report.metadata["torch_version"]
        if recorded != torch.__version__:
            console.print(f"note: {report.path} was recorded with torch {recorded}, this is torch {torch.__version__}")
    failed = [r for r in reports if not r.ok]
    if failed:
        raise GoldenMismatch(failed[0].failure())
    console.print(f"{len(reports)} golden file{'s' if len(reports) != 1 else ''}: every output within bounds")


def report_table(reports: list[golden.GoldenReport], steps: bool = False) -> Table:
    table = Table(title="Golden check: worst relative max-abs error per output", box=box.SIMPLE_HEAD,
                  pad_edge=False, caption="greedy tokens: error counts the tokens that differ, step is the "
                                          "first of them", caption_justify="left")
    for header, justify in (("golden", "left"), ("output", "left"), ("compared", "left"), ("step", "right"),
                            ("error", "right"), ("bound", "right"), ("result", "left")):
        table.add_column(header, justify=justify, no_wrap=True)
    for i, report in enumerate(reports):
        if i:
            table.add_section()
        for row in report.rows if steps else report.worst():
            table.add_row(report.name, row.output, f"{row.subject} vs {row.reference}", step(row), error(row),
                          "exact" if row.output == "greedy tokens" else f"{row.bound:.0e}",
                          "[green]pass[/green]" if row.ok else "[bold red]FAIL[/bold red]")
    return table


def step(row: golden.Comparison) -> str:
    if row.output == "greedy tokens":
        return "-" if row.divergence is None else str(row.divergence.index)
    return "-" if row.step is None else str(row.step)


def error(row: golden.Comparison) -> str:
    if row.output == "greedy tokens":
        return f"{int(row.error)}/{row.total}"
    return "nan/inf" if not math.isfinite(row.error) else f"{row.error:.2e}"
