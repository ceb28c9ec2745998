"""`dsv41c export`: AOTInductor packages of a model, with our passes, plus a manifest."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import torch
import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import dsv41c
from dsv41c.cli.run import (CHECKPOINT_CONFIG, DEFAULT_CONFIG, TORCH_DTYPES, Device, DType, config_default_text,
                            require_file, resolve_device)
from dsv41c.config import default_config
from dsv41c.compiler import DEFAULT_PASSES
from dsv41c.errors import InputError
from dsv41c.export import check_out_dir, program_specs


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)


def export_command(
    out: Path = typer.Option(..., "--out", metavar="DIR", help="The artifact directory to write (new or empty)."),
    config: Optional[Path] = typer.Option(
        None, "--config", metavar="PATH", show_default=config_default_text(DEFAULT_CONFIG),
        help="Model config JSON; the weights are random, from --seed."),
    model_dir: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR", help="Checkpoint directory to export instead of random weights."),
    passes: Optional[List[str]] = typer.Option(
        None, "--pass", metavar="NAME", show_default=", ".join(DEFAULT_PASSES),
        help="A pass to run; repeat for several, in order."),
    strict: bool = typer.Option(False, "--strict", help="A pass that matches nothing is an error."),
    max_prompt_len: Optional[int] = typer.Option(
        None, "--max-prompt-len", metavar="N", show_default="max_seq_len",
        help="The longest prompt the prefill package accepts."),
    short_prompts: bool = typer.Option(
        False, "--short-prompts",
        help="Also export a one-token program at each position below the decode package's range (a compile "
             "each), so that prompts shorter than the prefill package's range run a token at a time."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Activation and weight dtype."),
    kv_quant: bool = typer.Option(False, "--kv-quant/--no-kv-quant",
                                  help="Apply the official KV fake-quantisation in the exported programs."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights (with --config)."),
    device: Optional[Device] = typer.Option(
        None, "--device", show_default="cuda if available, else cpu",
        help="The device the packages are compiled for; they load only on such a device (CUDA: the same arch)."),
) -> None:
    """Export the model to DIR: AOTInductor packages of the prefill (dynamic prompt length) and
    the decode step, compiled with the same passes as `dsv41c compile`, the tokenizer and
    manifest.json (config, passes and their matches, versions, bounds, sha256 of every file).

    The AOTInductor compile takes minutes per package (on CPU, on one core). Load it with
    `dsv41c run --artifact DIR`.
    """
    if model_dir is not None and config is not None:
        raise InputError(f"--model {model_dir} and --config {config}: a checkpoint carries its own config, "
                         "give one of them")
    check_out_dir(out)
    target = resolve_device(device)
    if model_dir is not None:
        if not (model_dir / CHECKPOINT_CONFIG).is_file():
            raise InputError(f"--model {model_dir}: expected a checkpoint directory with {CHECKPOINT_CONFIG}")
        args = dsv41c.ModelArgs.from_json(model_dir / CHECKPOINT_CONFIG)
    else:
        config = config if config is not None else default_config(DEFAULT_CONFIG)
        args = dsv41c.ModelArgs.from_json(require_file(config, "--config"))
    if max_prompt_len is not None and not 1 <= max_prompt_len <= args.max_seq_len:
        raise InputError(f"--max-prompt-len {max_prompt_len}: expected 1..max_seq_len={args.max_seq_len}")
    names = tuple(passes) if passes is not None else DEFAULT_PASSES
    from dsv41c.passes.manager import build_pipeline
    build_pipeline(names, strict)               # unknown pass names fail now, not after the model build

    err, con = Console(stderr=True), Console(highlight=False)
    stages = 2 + 2 * len(program_specs())
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    t0 = time.perf_counter()
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("", total=stages)

        def stage(what: str) -> None:
            if not err.is_terminal:             # a log (no live display): one line per stage, with the time so far
                err.print(f"[{time.perf_counter() - t0:5.0f} s] {what}", highlight=False, soft_wrap=True)
            if progress.tasks[0].description:
                progress.advance(task)
            progress.update(task, description=what)

        if model_dir is not None:
            stage(f"loading {model_dir}")
            model = dsv41c.load_model(model_dir, dtype=TORCH_DTYPES[dtype], kv_quant=kv_quant, device=target)
            source = {"checkpoint": model_dir.name}
        else:
            stage(f"building {config} (seed {seed})")
            model = dsv41c.build_model(args, seed=seed, dtype=TORCH_DTYPES[dtype], kv_quant=kv_quant, device=target)
            source = {"config": config.name, "seed": seed}
        with torch.no_grad():
            dsv41c.export(model, out, names, strict, max_prompt_len=max_prompt_len, short_prompts=short_prompts,
                          source=source, on_stage=stage)
    seconds = time.perf_counter() - t0

    from dsv41c.export import read_manifest
    manifest = read_manifest(out)
    con.print(f"{out}: exported for {manifest['device'].get('name', 'cpu')} in {seconds:.0f} s "
              f"(torch {manifest['versions']['torch']}, "
              f"pipeline {manifest['passes']['uuid'][:12]})", soft_wrap=True)
    con.print(programs_table(manifest))


def programs_table(manifest: dict) -> Table:
    table = Table(title="Programs", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("file", "phase", "tokens / positions", "pass matches"):
        table.add_column(header)
    for p in manifest["programs"]:
        what = "prompt" if p["phase"] == "prefill" else "position"
        residue = f", ≡ {p['residue']} mod {p['period']}" if p["period"] > 1 else ""
        bounds = f"{what} {p['min']}" if p["min"] == p["max"] else f"{what} {p['min']}..{p['max']}{residue}"
        matches = ", ".join(f"{k} {v}" for k, v in (p["pass_matches"] or {}).items()) or "none"
        table.add_row(p["file"], p["phase"], bounds, matches)
    return table
