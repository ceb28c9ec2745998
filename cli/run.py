"""`dsv41c run`: generate text with the eager model, from random weights or a checkpoint, or with an
exported artifact (no compile)."""
from __future__ import annotations

import unicodedata
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import dsv41c
from dsv41c.config import default_config
from dsv41c.errors import InputError
from dsv41c.generate import GenerationResult, check_prompt, generate

DEFAULT_CONFIG = "tiny.json"  # `default_config`: configs/tiny.json here, else the installed copy
CHECKPOINT_CONFIG = "config.json"
CHECKPOINT_TOKENIZER = "tokenizer.json"


def config_default_text(name: str) -> str:
    """How --help shows a default built-in config (`default_config`)."""
    return f"configs/{name} in the current directory, else the installed copy"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


TORCH_DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16}


def register(app: typer.Typer) -> None:
    app.command("run", no_args_is_help=False)(run)


def run(
    config: Optional[Path] = typer.Option(
        None, "--config", metavar="PATH", show_default=config_default_text(DEFAULT_CONFIG),
        help="Model config JSON; the weights are random, from --seed."),
    model_dir: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR",
        help="Checkpoint directory (config.json, model.safetensors, optional tokenizer.json) to load "
             "instead of random weights. Not combined with --config or --tokenizer."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and of sampling."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (a BOS is prepended)."),
    prompt_ids: Optional[str] = typer.Option(
        None, "--prompt-ids", metavar="IDS", help='Raw prompt token ids, e.g. "256,84,104"; instead of --prompt.'),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Activation and weight dtype."),
    kv_quant: bool = typer.Option(True, "--kv-quant/--no-kv-quant",
                                  help="Apply the official KV fake-quantisation (FP8 window, FP4 compressed KV)."),
    packed_kv: bool = typer.Option(False, "--packed-kv/--plain-kv",
                                   help="Hold the KV caches in the packed deployment formats (needs --kv-quant)."),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", metavar="PATH", show_default="the built-in byte-level tokenizer",
        help="A tokenizer.json file."),
    device: Optional[Device] = typer.Option(None, "--device", show_default="cuda if available, else cpu",
                                            help="Where the model runs."),
    artifact: Optional[Path] = typer.Option(
        None, "--artifact", metavar="DIR",
        help="An exported artifact (dsv41c export) to run instead of the eager model: verified against "
             "its manifest, loaded without compiling. Carries its config, weights and tokenizer."),
) -> None:
    """Generate text: prefill the prompt, then decode --max-new-tokens tokens.

    Prints the text, then the prefill and decode rates in tokens/s.
    """
    if prompt is not None and prompt_ids is not None:
        raise InputError("--prompt and --prompt-ids: give one of them, not both")
    if prompt is None and prompt_ids is None:
        raise InputError("no prompt: give --prompt TEXT or --prompt-ids IDS")
    if model_dir is not None and config is not None:
        raise InputError(f"--model {model_dir} and --config {config}: a checkpoint carries its own config, "
                         "give one of them")
    if model_dir is not None and tokenizer is not None:
        raise InputError(f"--model {model_dir} and --tokenizer {tokenizer}: a checkpoint carries its own "
                         "tokenizer, give one of them")
    if artifact is not None:
        given = [name for name, value in (("--config", config), ("--model", model_dir), ("--tokenizer", tokenizer),
                                          ("--device", device)) if value is not None]
        if given:
            raise InputError(f"--artifact {artifact} and {given[0]}: an artifact carries its own config, weights, "
                             "tokenizer and target device, give one of them")
        return run_artifact(artifact, prompt, prompt_ids, max_new_tokens, temperature, seed)
    target = resolve_device(device)
    storage = "packed" if packed_kv else "plain"
    if packed_kv and not kv_quant:
        raise InputError("--packed-kv stores the quantised formats: it needs --kv-quant")

    if model_dir is not None:
        if not model_dir.is_dir():
            raise InputError(f"--model {model_dir}: expected a checkpoint directory, found "
                             f"{'a file' if model_dir.exists() else 'nothing'}")
        if not (model_dir / CHECKPOINT_CONFIG).is_file():
            raise InputError(f"--model {model_dir}: expected a checkpoint directory with {CHECKPOINT_CONFIG}, "
                             f"found no {CHECKPOINT_CONFIG} there")
        args = dsv41c.ModelArgs.from_json(model_dir / CHECKPOINT_CONFIG)
        tok_file = model_dir / CHECKPOINT_TOKENIZER
        tok = dsv41c.load_tokenizer(tok_file if tok_file.is_file() else None)
    else:
        config = config if config is not None else default_config(DEFAULT_CONFIG)
        args = dsv41c.ModelArgs.from_json(require_file(config, "--config"))
        tok = dsv41c.load_tokenizer(require_file(tokenizer, "--tokenizer") if tokenizer is not None else None)

    ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else tok.encode(prompt)
    # Checked against the config before the (possibly long) model build.
    check_prompt(args, ids, max_new_tokens)

    err = Console(stderr=True)
    with progress_display(err) as progress:
        what = f"loading {model_dir}" if model_dir is not None else f"building {config} (seed {seed})"
        task = progress.add_task(f"{what} on {target}", total=None)
        if model_dir is not None:
            model = dsv41c.load_model(model_dir, dtype=TORCH_DTYPES[dtype], kv_quant=kv_quant, device=target,
                                      kv_storage=storage)
        else:
            model = dsv41c.build_model(args, seed=seed, dtype=TORCH_DTYPES[dtype], kv_quant=kv_quant,
                                       device=target, tokenizer=tok, kv_storage=storage)
        progress.remove_task(task)
        result = generate_with_progress(progress, model, ids, max_new_tokens, temperature, seed)
    typer.echo(printable(result.text))
    typer.echo(rates_line(result))


def generate_with_progress(progress, model, ids, max_new_tokens: int, temperature: float, seed: int):
    """`generate`, advancing a "generating" task of `progress` per token."""
    task = progress.add_task("generating", total=max_new_tokens)
    return generate(model, ids, max_new_tokens, temperature=temperature, seed=seed,
                    on_token=lambda _: progress.advance(task))


def run_artifact(path: Path, prompt: Optional[str], prompt_ids: Optional[str], max_new_tokens: int,
                 temperature: float, seed: int) -> None:
    """Generate with an exported artifact; its bounds are checked before any token is computed."""
    err = Console(stderr=True)
    with progress_display(err) as progress:
        task = progress.add_task(f"verifying and loading {path}", total=None)
        model = dsv41c.load_artifact(path)
        ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else model.tokenizer.encode(prompt)
        check_prompt(model.args, ids, max_new_tokens)
        model.check_generation(len(ids), max_new_tokens)
        progress.remove_task(task)
        result = generate_with_progress(progress, model, ids, max_new_tokens, temperature, seed)
    typer.echo(printable(result.text))
    typer.echo(rates_line(result))


def resolve_device(device: Optional[Device]) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device is Device.cuda and not torch.cuda.is_available():
        raise InputError("--device cuda: expected a CUDA device, found none (torch.cuda.is_available() is False)")
    return device.value


def require_file(path: Path, option: str) -> Path:
    if not path.is_file():
        found = "a directory" if path.is_dir() else "nothing"
        raise InputError(f"{option} {path}: expected a file, found {found}")
    return path


def parse_prompt_ids(text: str) -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("+-").isdigit())
        raise InputError(f"--prompt-ids: expected comma-separated integers, found {bad!r}") from None


def printable(text: str) -> str:
    """The text with control characters (other than newline and tab) shown as escapes, so that
    random-weight output cannot drive the terminal."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def rates_line(result: GenerationResult) -> str:
    # The first new token comes out of the prefill; each decode step adds one.
    decode_steps = max(len(result.new_ids) - 1, 0)
    return (f"{tokens(len(result.new_ids))} generated | "
            f"prefill: {tokens(len(result.prompt_ids))}, {result.prefill_tok_s:.1f} tokens/s | "
            f"decode: {tokens(decode_steps)}, {result.decode_tok_s:.1f} tokens/s")


@contextmanager
def progress_display(console: Console):
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    # Off when stderr is not a terminal: there it would only leave a blank line behind.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        yield progress
