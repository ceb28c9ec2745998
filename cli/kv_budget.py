"""`dsv41c kv-budget`: the KV memory of one sequence, from a config (spec §11)."""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

import dsv41c
from dsv41c.cli.run import config_default_text
from dsv41c.config import default_config
from dsv41c.errors import ConfigError, InputError
from dsv41c.kv_budget import DEFAULT_CONTEXT, KVBudget, kv_budget

DEFAULT_CONFIG = "flash.json"  # `default_config`


def register(app: typer.Typer) -> None:
    app.command("kv-budget", no_args_is_help=False)(kv_budget_command)


def kv_budget_command(
    config: Optional[Path] = typer.Option(
        None, "--config", metavar="PATH", show_default=config_default_text(DEFAULT_CONFIG),
        help="Model config JSON."),
    context: int = typer.Option(DEFAULT_CONTEXT, "--context", metavar="N", help="Tokens held by the sequence."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object instead of tables."),
) -> None:
    """Print the KV cache bytes of one sequence: global KV and index keys per token and per source,
    the fixed per-sequence state (window rings, compressor partial groups, n-gram tail), the total
    at --context tokens, what is persisted, and the same in bf16 against the naive baseline.
    """
    config = config if config is not None else default_config(DEFAULT_CONFIG)
    if not config.is_file():
        found = "a directory" if config.is_dir() else "nothing"
        raise ConfigError(f"--config {config}: expected a config file, found {found}")
    if context < 0:
        raise InputError(f"--context {context}: expected a token count >= 0")
    args = dsv41c.ModelArgs.from_json(config)
    budget = kv_budget(args, context)
    if as_json:
        typer.echo(json.dumps({"config": str(config), "max_seq_len": args.max_seq_len, **budget.to_dict()},
                              indent=2))
        return
    console = Console(highlight=False)
    console.print(sources_table(budget))
    console.print(sequence_table(budget))
    for line in summary_lines(budget, args.head_dim):
        console.print(line)
    if context > args.max_seq_len:
        console.print(f"note: --context {context:,} is beyond the config's max_seq_len {args.max_seq_len:,}")


def sources_table(budget: KVBudget) -> Table:
    packed, bf16 = budget.packed, budget.bf16
    table = Table(title="Global KV per token (packed: FP4+E4M3 KV, MXFP4 index keys)", show_footer=True)
    columns = [
        ("kv\nsource", "total", "left"),
        ("ratio", "", "right"),
        ("read\nby", "", "left"),
        ("KV\nentry", "", "right"),
        ("KV\nB/tok", number(packed.kv_bytes_per_token), "right"),
        ("index\nkey", "", "right"),
        ("index\nB/tok", number(packed.index_bytes_per_token), "right"),
        ("total\nB/tok", number(packed.bytes_per_token), "right"),
        ("bf16\nB/tok", number(bf16.bytes_per_token), "right"),
    ]
    for header, footer, justify in columns:
        table.add_column(header, footer=footer, justify=justify, no_wrap=True)
    for src, twin in zip(packed.sources, bf16.sources):
        table.add_row(
            str(src.layer_id), str(src.ratio), layer_ranges(src.readers), number(src.kv_entry_bytes),
            number(src.kv_bytes_per_token), number(src.index_entry_bytes) if src.owns_index_keys else "-",
            number(src.index_bytes_per_token), number(src.bytes_per_token), number(twin.bytes_per_token))
    return table


def sequence_table(budget: KVBudget) -> Table:
    packed, bf16 = budget.packed, budget.bf16
    tokens = f"{budget.context:,} tokens"
    table = Table(title="One sequence, in bytes")
    table.add_column("", no_wrap=True)
    table.add_column("packed", justify="right", no_wrap=True)
    table.add_column("bf16", justify="right", no_wrap=True)
    table.add_column("bf16/packed", justify="right", no_wrap=True)

    def row(label: str, pick) -> None:
        a, b = pick(packed), pick(bf16)
        table.add_row(label, number(a), number(b), times(Fraction(b) / a if a else None))

    row("KV, per token", lambda c: c.kv_bytes_per_token)
    row("index keys, per token", lambda c: c.index_bytes_per_token)
    row("global, per token", lambda c: c.bytes_per_token)
    row(f"global, {tokens}", lambda c: c.global_bytes)
    table.add_section()
    row(f"window rings, {packed.backbone_layers} × {packed.window_size}", lambda c: c.backbone_window_bytes)
    if packed.dspark_stages:
        row(f"window rings, DSpark {packed.dspark_stages} × {packed.window_size}", lambda c: c.dspark_window_bytes)
    row("compressor partial groups (fp32)", lambda c: c.partial_group_bytes)
    row(f"n-gram tail ({packed.ngram_tail_ids} ids)", lambda c: c.ngram_tail_bytes)
    row("fixed per sequence", lambda c: c.fixed_bytes)
    table.add_section()
    row(f"held, {tokens}", lambda c: c.total_bytes)
    row("persisted, per token", lambda c: c.persistent_bytes_per_token)
    row(f"persisted, {tokens}", lambda c: c.persistent_bytes)
    return table


def summary_lines(budget: KVBudget, head_dim: int) -> list[str]:
    packed, bf16 = budget.packed, budget.bf16
    return [
        f"{budget.context:,} tokens: {size(packed.global_bytes)} global + {size(packed.fixed_bytes)} fixed = "
        f"{size(packed.total_bytes)} (bf16: {size(bf16.total_bytes)})",
        f"persisted: {size(packed.persistent_bytes)}, the global state only (the window rings are not persisted)",
        f"naive: {packed.backbone_layers} layers × {head_dim} bf16 values = {number(budget.naive_bytes_per_token)} "
        f"B/token ({times(budget.naive_ratio)} packed, {times(budget.naive_bf16_ratio)} bf16)",
    ]


def number(x: int | Fraction) -> str:
    x = Fraction(x)
    return f"{int(x):,}" if x.denominator == 1 else f"{float(x):,.2f}".rstrip("0").rstrip(".")


def times(ratio: float | Fraction | None) -> str:
    return "-" if ratio is None else f"{float(ratio):.1f}×"


def size(n: int) -> str:
    """Bytes in the largest binary unit they reach: 890 MiB, 2.58 MiB, 24 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.2f} {unit}"
    return f"{n} B"


def layer_ranges(ids: tuple[int, ...]) -> str:
    """(2, 3, 4, 7) -> "2-4, 7"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
