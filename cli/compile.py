"""`dsv41c compile`: compile a config's model with the pass pipeline and report what the passes did."""
from __future__ import annotations

import time
from contextlib import nullcontext
from enum import Enum
from pathlib import Path
from typing import List, Optional

import torch
import typer
from rich import box
from rich.console import Console
from rich.table import Table

import dsv41c
from dsv41c.cli.run import DEFAULT_CONFIG, TORCH_DTYPES, Device, DType, config_default_text, resolve_device
from dsv41c.compiler import BACKENDS, DEFAULT_PASSES, CompiledModel, GraphSnapshot
from dsv41c.config import default_config
from dsv41c.errors import InputError
from dsv41c.export import built_in_place, check_out_dir
from dsv41c.golden import relative_error

Backend = Enum("Backend", {b: b for b in BACKENDS}, type=str)
COUNT_COLUMNS = (("GEMMs", "gemms"), ("batched GEMMs", "batched_gemms"), ("mHC ops", "mhc"),
                 ("cache writes", "cache_writes"), ("nodes", "nodes"))


def register(app: typer.Typer) -> None:
    app.command("compile")(compile_command)


def compile_command(
    config: Optional[Path] = typer.Option(None, "--config", metavar="PATH",
                                          show_default=config_default_text(DEFAULT_CONFIG), help="Model config JSON."),
    report: bool = typer.Option(False, "--report", help="Print the passes, op counts, compile time and rates."),
    dump_graphs: Optional[Path] = typer.Option(
        None, "--dump-graphs", metavar="DIR",
        help="Write each graph before and after each pass as readable code into DIR (a new directory)."),
    backend: Backend = typer.Option(
        Backend.inductor, "--backend",
        help="inductor generates code (minutes per graph on a CPU); passes_only runs the rewritten "
             "post-grad graph without code generation."),
    passes: Optional[List[str]] = typer.Option(
        None, "--pass", metavar="NAME", show_default=", ".join(DEFAULT_PASSES),
        help="A pass to run; repeat for several, in order."),
    strict: bool = typer.Option(False, "--strict", help="A pass that matches nothing is an error."),
    cpp_wrapper: bool = typer.Option(False, "--cpp-wrapper",
                                     help="Inductor's C++ wrapper: less host time per kernel launch."),
    cudagraphs: bool = typer.Option(False, "--cudagraphs",
                                    help="Decode steps replay CUDA graphs (experimental; --device cuda, "
                                         "--backend inductor, without --cpp-wrapper)."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Activation and weight dtype."),
    kv_quant: bool = typer.Option(False, "--kv-quant/--no-kv-quant",
                                  help="The official KV fake-quantisation (the fp4_kv pass needs it)."),
    device: Optional[Device] = typer.Option(None, "--device", show_default="cuda if available, else cpu",
                                            help="Where the model is built and compiled."),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", metavar="N", show_default="3 × window_size + 1",
                                             help="Prompt tokens of the measured prefill (batch 1)."),
    decode_steps: int = typer.Option(4, "--decode-steps", metavar="N", help="Measured decode steps."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and of the prompt."),
) -> None:
    """Compile the model of --config (random weights; float32 and kv_quant off unless --dtype and
    --kv-quant say otherwise) with dsv41c.compile.

    Runs a prefill and --decode-steps decode steps once to compile their graphs, then times them
    eager and compiled. Prints the graphs compiled, the compile time, the pass matches and both
    rates; --report adds the op counts of every graph before the passes and after each one.
    """
    config = config if config is not None else default_config(DEFAULT_CONFIG)
    if not config.is_file():
        raise InputError(f"--config {config}: expected a config file, found "
                         f"{'a directory' if config.is_dir() else 'nothing'}")
    if cpp_wrapper and backend != Backend.inductor:
        raise InputError(f"--cpp-wrapper: generates Inductor's wrapper code; --backend {backend.value} generates none "
                         f"(use --backend inductor)")
    target = resolve_device(device)
    if cudagraphs and (target != "cuda" or backend != Backend.inductor or cpp_wrapper):
        raise InputError(f"--cudagraphs: needs --device cuda, --backend inductor and no --cpp-wrapper; found "
                         f"--device {target}, --backend {backend.value}{' and --cpp-wrapper' if cpp_wrapper else ''}")
    if dump_graphs is not None:
        check_out_dir(dump_graphs, "--dump-graphs")
    args = dsv41c.ModelArgs.from_json(config)
    prompt_len = 3 * args.window_size + 1 if prompt_len is None else prompt_len
    if prompt_len < 1 or decode_steps < 0:
        raise InputError(f"--prompt-len {prompt_len} / --decode-steps {decode_steps}: expected >= 1 and >= 0")
    if prompt_len + decode_steps > args.max_seq_len:
        raise InputError(f"--prompt-len + --decode-steps: {prompt_len} + {decode_steps} exceeds max_seq_len="
                         f"{args.max_seq_len} of {config}")

    err, out = Console(stderr=True), Console(highlight=False)
    with (err.status("building the model") if err.is_terminal else nullcontext()) as status:
        model = dsv41c.build_model(args, seed=seed, dtype=TORCH_DTYPES[dtype], kv_quant=kv_quant, device=target)
        compiled = dsv41c.compile(model, tuple(passes) if passes is not None else DEFAULT_PASSES, strict,
                                  backend=backend.value, observe=True, keep_code=dump_graphs is not None,
                                  cpp_wrapper=cpp_wrapper, cudagraphs=cudagraphs)
        ids = torch.randint(0, args.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(target)
        calls = [(ids, 0, f"prefill of {prompt_len}")]
        token = model(ids, 0).argmax(-1, keepdim=True)           # eager: the decode steps' input tokens
        for i in range(decode_steps):
            calls.append((token, prompt_len + i, f"decode at position {prompt_len + i}"))
            token = model(token, prompt_len + i).argmax(-1, keepdim=True)
        labels, errors = first_pass(compiled, model, calls, status)
        eager_rates = rates(model, calls)
        compiled_rates = rates(compiled, calls)

    if dump_graphs is not None:
        write_graphs(dump_graphs, compiled.snapshots, labels)
    stats = compiled.pipeline.stats
    out.print(f"{config}: {compiled.graphs} graph{'s' if compiled.graphs != 1 else ''} compiled in "
              f"{compiled.compile_seconds:.1f} s (backend {backend.value}); passes: "
              + (", ".join(f"{s.name} {s.matches} matches" for s in stats.values()) or "none"), soft_wrap=True)
    if report:
        out.print(passes_table(compiled))
        out.print(counts_table(compiled.snapshots, labels))
    out.print(rates_table(eager_rates, compiled_rates, backend.value + (", CUDA graphs" if cudagraphs else ""),
                          model.device.type))
    out.print(f"worst relative max-abs error of the compiled logits against eager: {max(errors, default=0.0):.2e}",
              soft_wrap=True)
    if dump_graphs is not None:
        out.print(f"graphs written to {dump_graphs}")


def first_pass(compiled: CompiledModel, model, calls, status) -> tuple[dict[int, str], list[float]]:
    """Run every call once compiled (this compiles), labelling each new graph with the call that
    compiled it; returns the labels and each call's error against eager."""
    labels, errors = {}, []
    model.reset_cache()
    eager = [model(ids, pos) for ids, pos, _ in calls]
    model.reset_cache()
    for (ids, pos, what), ref in zip(calls, eager):
        if status is not None:
            status.update(f"compiling and running the {what} (backend {compiled.backend}; "
                          f"{compiled.compile_seconds:.0f} s compiling so far)")
        before = compiled.graphs
        errors.append(relative_error(compiled(ids, pos), ref))
        for g in range(before + 1, compiled.graphs + 1):
            labels[g] = what
    return labels, errors


def rates(fn, calls) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one pass over `calls` from an empty cache, each phase
    timed to the end of its device work."""
    device = calls[0][0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn.reset_cache()
    sync()
    t0 = time.perf_counter()
    fn(calls[0][0], 0)
    sync()
    prefill = calls[0][0].shape[1] / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for ids, pos, _ in calls[1:]:
        fn(ids, pos)
    sync()
    decode = (len(calls) - 1) / (time.perf_counter() - t0) if len(calls) > 1 else float("nan")
    return prefill, decode


def passes_table(compiled: CompiledModel) -> Table:
    table = Table(title="Passes", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("pass", "matches", "nodes removed", "nodes added", "first matches"):
        table.add_column(header, justify="left" if header in ("pass", "first matches") else "right")
    for s in compiled.pipeline.stats.values():
        table.add_row(s.name, str(s.matches), str(s.nodes_removed), str(s.nodes_added), "; ".join(s.details[:3]))
    return table


def counts_table(snapshots: list[GraphSnapshot], labels: dict[int, str]) -> Table:
    table = Table(title="Op counts of the post-grad graphs (before the passes, then after each)",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="GEMMs: aten.mm/addmm; batched: aten.bmm; mHC ops: nodes traced from dsv41c/mhc.py; "
                          "cache writes: aten.copy_ into a graph input", caption_justify="left")
    for header in ("graph", "compiled for", "stage", *(h for h, _ in COUNT_COLUMNS)):
        table.add_column(header, justify="right" if header not in ("compiled for", "stage") else "left")
    last = None
    for s in snapshots:
        if last is not None and s.graph != last:
            table.add_section()
        last = s.graph
        table.add_row(str(s.graph), labels.get(s.graph, "?"), "as traced" if s.stage == "input" else f"after {s.stage}",
                      *(str(getattr(s.counts, key)) for _, key in COUNT_COLUMNS))
    return table


def rates_table(eager: tuple[float, float], compiled: tuple[float, float], backend: str, device: str) -> Table:
    table = Table(title=f"Eager vs compiled ({backend}), tokens/s on {device}", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("phase", "eager", "compiled", "x eager"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for phase, e, c in (("prefill", eager[0], compiled[0]), ("decode", eager[1], compiled[1])):
        table.add_row(phase, f"{e:.1f}", f"{c:.1f}", f"{c / e:.2f}")
    return table


# ------------------------------------------------------------------------------ graph dumps
def write_graphs(path: Path, snapshots: list[GraphSnapshot], labels: dict[int, str]) -> None:
    """`graph<g>_<k>_<stage>.py` per snapshot, written into a temp directory beside DIR and renamed
    into place, so DIR is either complete or absent."""
    with built_in_place(path) as tmp:
        stage_index: dict[int, int] = {}
        for s in snapshots:
            k = stage_index[s.graph] = stage_index.get(s.graph, -1) + 1
            stage = "as_traced" if s.stage == "input" else f"after_{s.stage}"
            header = f"# graph {s.graph} ({labels.get(s.graph, '?')}), {stage.replace('_', ' ')}: {s.counts}\n"
            (tmp / f"graph{s.graph}_{k}_{stage}.py").write_text(header + (s.code or ""), encoding="utf-8")
