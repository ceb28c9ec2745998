"""`dsv41c.export`: the model as AOTInductor packages plus a manifest; `load_artifact` runs them
without recompiling.

An artifact directory holds:

    prefill.pt2, decode.pt2   AOTInductor packages (one per program, see "Programs" below), code only
    weights.safetensors       the constants of every package, each distinct tensor once
    tokenizer.json            the model's tokenizer
    manifest.json             config, passes and their matches, versions, bounds, sha256 of every file

Caches are inputs. `Transformer.forward` mutates the caches it owns as buffers; exported as they
are, each package would hold a private copy, and the decode package would never see what the
prefill wrote. So each program is a small wrapper whose forward takes the cache tensors as explicit
inputs (bound into the model with `torch.func.functional_call`) and writes them in place; the
loader owns one set of caches and passes it to every program. The export runs with grad disabled:
the model's own `@torch.no_grad()` would otherwise wrap the graph in a higher-order op that hides
the cache writes from the exported signature.

Weights are stored once, outside the packages. As in `dsv41c.compile`, Inductor freezes the
parameters, and our passes build new constants from them (fuse_wqa_wkv concatenates sibling
weights, lower_mhc takes the mHC coefficients into its kernels), so the constants a package runs on
are not the checkpoint's tensors. AOTInductor compiles each package without its constants
(`package_constants_in_so` off) and writes them beside its code (`pickle_weights`); the export then
moves them into one `weights.safetensors`, each distinct tensor once (the prefill and decode
packages share almost all of them), and records in the manifest which stored tensor, viewed with
which shape, stride and offset, each package constant is. The loader reads the file once, onto the
packages' device, and hands the same tensors to every package (`load_constants`, user-managed). A
model of W bytes of weights is then a W-byte artifact and W bytes in memory, whatever the number of
programs; embedded, each package would carry and load its own copy.

Programs. The model branches in Python on shapes: the window and top-k widths on min(W, t) and
min(k, n). torch.export turns such a branch into a guard that the exported program asserts, so one
program cannot cover every length. Lengths are written as t = period * k + residue, k a dynamic
dimension whose range torch.export narrows (`Dim.AUTO`) to where those branches are settled.
Prefill takes the prompt as a [1, k, period] body and a [1, residue] tail; decode reads its position
from the length of an empty [k, 0] marker. Both take the same branches at every residue (the
compressor writes its open group without a branch on the remainder), so export writes period 1:
one prefill.pt2 and one decode.pt2. Artifacts from before that hold one prefill package per residue
of the lcm of the compress ratios (`prefill.r<i>.pt2`); the loader still runs them. The narrowed
ranges are the artifact's bounds; `load_artifact` refuses a call outside them (the packages do not
check). A dynamic range never holds a size of 1 (torch.export specialises it), so the shortest
prompts and first positions lie below the ranges; `short_prompts` adds a static one-token program
at each position below the decode program's (`decode.p<i>.pt2`), and the loader runs a prompt
shorter than the prefill's range a token at a time through them (`artifact_bounds`).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from dsv41c.cache import ModelCache
from dsv41c.compiler import (CPP_WRAPPER_WORKAROUNDS, DEFAULT_PASSES, experts_without_shim, inductor_options,
                             opaque_grouped_mm)
from dsv41c.config import ModelArgs, build_layer_plan
from dsv41c.errors import ArtifactError, InputError, unwrapped
from dsv41c.golden import QUANT_RUNNER_BOUND, RUNNER_BOUND, file_sha256, relative_error
from dsv41c.model import Transformer, check_token_range
from dsv41c.passes.manager import build_pipeline
from dsv41c.tokenizer import Tokenizer

FORMAT = 3                     # 2: "device" is an object; 3: weights outside the packages
MANIFEST_FILE, TOKENIZER_FILE, WEIGHTS_FILE = "manifest.json", "tokenizer.json", "weights.safetensors"
# AOTInductor: no constants in the compiled library; handed back as a `Weights` entry of its file
# list (`compile_package` stores them in WEIGHTS_FILE, not in the package)
WEIGHTS_OUTSIDE = {"aot_inductor.package_constants_in_so": False,
                   "aot_inductor.package_constants_on_disk_format": "pickle_weights"}
CACHE_PREFIX = "cache."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCH = 1                      # generation runs one sequence; the programs are exported for it


# ------------------------------------------------------------------------------ versions
def versions() -> dict[str, str]:
    """What a package is bound to: the torch build (the packages are compiled C++ against its ABI),
    TileLang (the custom ops' kernels) and dsv41c (the model code and the ops' schemas)."""
    import importlib.metadata

    from dsv41c import __version__
    try:
        tilelang = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        tilelang = "absent"
    return {"torch": torch.__version__, "tilelang": tilelang, "dsv41c": __version__}


sha256 = file_sha256  # the sha256 of a file, as the golden manifest records it


def cache_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_buffers() if n.startswith(CACHE_PREFIX)]


# ------------------------------------------------------------------------------ exported wrappers
class _Step(nn.Module):
    """Runs `model` with its cache buffers replaced by the tensors passed in (written in place)."""

    def __init__(self, model: Transformer, period: int, residue: int):
        super().__init__()
        self.model, self.period, self.residue = model, period, residue
        self.names = [n[len(CACHE_PREFIX):] for n in cache_names(model)]

    def run(self, ids: torch.Tensor, start_pos, caches: list[torch.Tensor]) -> torch.Tensor:
        bound = {CACHE_PREFIX + n: c for n, c in zip(self.names, caches, strict=True)}
        return torch.func.functional_call(self.model, bound, (ids, start_pos), tie_weights=False)


class PrefillStep(_Step):
    """Prompt of period * k + residue tokens: body [1, k, period], tail [1, residue]."""

    def forward(self, body: torch.Tensor, tail: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        return self.run(torch.cat([body.flatten(1), tail], dim=1), 0, caches)


class DecodeStep(_Step):
    """One token at position period * k + residue, k = marker.shape[0] (marker is [k, 0], empty)."""

    def forward(self, ids: torch.Tensor, marker: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        return self.run(ids, marker.shape[0] * self.period + self.residue, caches)


def prefill_inputs(ids: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = ids.shape[1]
    body = s - s % period
    return ids[:, :body].reshape(ids.shape[0], body // period, period), ids[:, body:]


def decode_marker(start_pos: int, period: int, device) -> torch.Tensor:
    return torch.empty(start_pos // period, 0, device=device)


def target_of(device: torch.device) -> dict[str, str]:
    """The device a package is compiled for: {"type": "cpu"} or the CUDA device's name and arch."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "arch": f"sm_{major}{minor}"}
    if device.type == "cpu":
        return {"type": "cpu"}
    raise InputError(f"export: no AOTInductor target for a model on {device} (cpu or cuda)")


# ------------------------------------------------------------------------------ export
@dataclass
class ProgramSpec:
    """One package: phase "prefill" (lo..hi: prompt lengths) or "decode" (lo..hi: positions), all
    congruent to residue mod period."""
    phase: str
    period: int
    residue: int
    file: str
    lo: int = 0
    hi: int = 0
    pass_matches: dict | None = None
    code_sha256: str = ""
    constants: dict | None = None          # constant name -> [stored tensor, shape, stride, offset]
    static: bool = False                   # a decode step at the one position lo (`short_step_specs`)

    def covers(self, t: int) -> bool:
        return t % self.period == self.residue and self.lo <= t <= self.hi


def program_specs() -> list[ProgramSpec]:
    """One prefill package and one decode package: each takes the same branches at every residue
    of the length (see "Programs" in the module docstring)."""
    return [ProgramSpec("prefill", 1, 0, "prefill.pt2"), ProgramSpec("decode", 1, 0, "decode.pt2")]


def short_step_specs(first_decode: int) -> list[ProgramSpec]:
    """Static one-token programs at the positions 0 .. first_decode - 1, below the decode program's
    range (`export(short_prompts=True)`): with them a prompt shorter than the prefill program's
    range runs a token at a time, and decoding may start from any position. Position 0 is the
    prompt's first token alone."""
    return [ProgramSpec("decode", 1, 0, f"decode.p{pos}.pt2", pos, pos, static=True) for pos in range(first_decode)]


def artifact_bounds(specs: Sequence[ProgramSpec]) -> dict[str, list[int]]:
    """The prompt lengths and decode positions the programs cover. Decode programs count from the
    lowest position up to the first gap; when they cover every position before the prefill's
    range, any shorter prompt runs through them a token at a time (`Artifact.__call__`)."""
    prefill = [s for s in specs if s.phase == "prefill"]
    decode = sorted((s for s in specs if s.phase == "decode"), key=lambda s: s.lo)
    p_lo, p_hi = max(s.lo for s in prefill), min(s.hi for s in prefill)   # (older artifacts: one per residue)
    d_lo, d_hi = decode[0].lo, decode[0].hi
    for spec in decode[1:]:
        if spec.lo > d_hi + 1:
            break
        d_hi = max(d_hi, spec.hi)
    if d_lo == 0 and d_hi >= p_lo - 1:
        p_lo = 1
    return {"prompt_len": [p_lo, p_hi], "decode_pos": [max(d_lo, 1), d_hi]}


def _dim_range(ep, placeholder: str, dim: int, period: int, residue: int) -> tuple[int, int]:
    """The range torch.export settled for `placeholder`'s dim, as token counts / positions."""
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == placeholder)
    size = node.meta["val"].shape[dim]
    if isinstance(size, int):
        lo = hi = size                                   # specialised: one length only
    else:
        vr = ep.range_constraints[size.node.expr]
        lo, hi = int(vr.lower), int(vr.upper)
        _check_guards(ep, placeholder, dim, range(lo, hi + 1), period, residue)
    return lo * period + residue, hi * period + residue


def _check_guards(ep, placeholder: str, dim: int, sizes: range, period: int, residue: int) -> None:
    """Every size in `sizes` of `placeholder`'s dim passes the guards torch.export kept.

    torch.export states what it learnt about a dynamic size as a range where it can, and keeps the
    rest as guard expressions (`ExportedProgram._guards_code`, e.g. `min(128, s) == 128` from a
    Python loop over a length-dependent count) that only `ep.module()` checks when it runs. An
    AOTInductor package checks none of them: at a length that fails one it runs code traced for
    other lengths, silently. So each size of the range is tried here, on shapes alone: the guard
    expressions evaluated on the inputs' sizes (a few microseconds a size), or where one cannot be
    read that way, the guard function `ep.module()` builds, on meta tensors (slower).
    """
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    from torch.utils import _pytree as pytree

    codes = list(getattr(ep, "_guards_code", None) or [])
    if not codes:
        return
    leaves = pytree.tree_leaves(ep.example_inputs)
    at = ep.graph_signature.user_inputs.index(placeholder)
    shape = list(leaves[at].shape)

    class Sizes:                                        # an input as the guard expressions read it
        def __init__(self, shape):
            self.shape = tuple(shape)

        def size(self):
            return self.shape

    flat = [Sizes(t.shape) if isinstance(t, torch.Tensor) else t for t in leaves]
    scope = {**SYMPY_INTERP, "L": {"flat_args": flat}}
    compiled = [(code, compile(code, "<guard>", "eval")) for code in codes]
    guard_fn, meta = None, None

    def torch_guards() -> str | None:
        nonlocal guard_fn, meta
        if guard_fn is None:
            guard_fn = ep.module(check_guards=True)._guards_fn
            meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in leaves]
        meta[at] = torch.empty(shape, dtype=leaves[at].dtype, device="meta")
        try:
            guard_fn(*meta)
        except (AssertionError, ZeroDivisionError) as e:
            return str(e).splitlines()[0]
        except Exception as e:
            raise ArtifactError(f"export: cannot evaluate the shape guards torch.export kept ({type(e).__name__}: "
                                f"{e}), so the program's range is not vouched for; nothing was written") from e
        return None

    def first_failure(k: int) -> str | None:
        shape[dim] = k
        flat[at] = Sizes(shape)
        for code, c in compiled:
            try:
                holds = eval(c, scope)
            except ZeroDivisionError:                   # not evaluable at this size: not vouched for
                holds = False
            except Exception:                           # a form this reading does not know
                return torch_guards()
            if not holds:
                return f"Guard failed: {code}"
        return None

    failed: dict[str, list[int]] = {}
    for k in sizes:
        if (why := first_failure(k)) is not None:
            why = why.replace(f"L['flat_args'][{at}].size()[{dim}]", f"{placeholder}.size({dim})")
            failed.setdefault(why, []).append(k * period + residue)
    if failed:
        what = "prompt lengths" if placeholder == "body" else "positions"
        lo, hi = sizes[0] * period + residue, sizes[-1] * period + residue
        raise ArtifactError(
            f"export: the traced program's shape guards fail inside its own range of {what} {lo}..{hi} "
            "(AOTInductor would not check them, and run code traced for other lengths there): "
            + "; ".join(f"{g!r} at {len(ts)} of them ({', '.join(map(str, ts[:4]))}{', ...' if len(ts) > 4 else ''})"
                        for g, ts in failed.items())
            + ". The model takes a length-dependent branch torch.export could not state as a range; "
            "nothing was written.")


def example_count(k_max: int) -> int:
    """The dynamic size a program is traced at, and that AOTInductor tunes its kernels for: half its
    largest (at least 2, so that torch.export does not specialise it)."""
    return max(2, k_max // 2)


def _export_program(model: Transformer, spec: ProgramSpec, caches: list[torch.Tensor], max_prompt_len: int):
    # The steps swap the caches in for the model's cache buffers (`_Step.run`, functional_call) and
    # back, which Dynamo reports as side effects on each cache module's buffers, a long warning per
    # program. They are the point of the wrapper: torch.export lifts the caches as inputs written in
    # place, and the artifact's check (`check_artifact`) runs it against the model.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects",
                                category=UserWarning)
        return _export_step(model, spec, caches, max_prompt_len)


def _export_step(model: Transformer, spec: ProgramSpec, caches: list[torch.Tensor], max_prompt_len: int):
    from torch.export import Dim
    args, p, r, dev = model.args, spec.period, spec.residue, model.device
    if spec.phase == "prefill":
        k_max = (max_prompt_len - r) // p
        k_ex = example_count(k_max)
        example = (torch.zeros(BATCH, k_ex, p, dtype=torch.long, device=dev),
                   torch.zeros(BATCH, r, dtype=torch.long, device=dev), caches)
        shapes = {"body": {1: Dim.AUTO(min=1, max=k_max)}, "tail": None, "caches": [None] * len(caches)}
        ep = torch.export.export(PrefillStep(model, p, r), example, dynamic_shapes=shapes, strict=True)
        return ep, _dim_range(ep, "body", 1, p, r)
    if spec.static:
        example = (torch.zeros(BATCH, 1, dtype=torch.long, device=dev), torch.empty(spec.lo, 0, device=dev), caches)
        return torch.export.export(DecodeStep(model, p, r), example, strict=True), (spec.lo, spec.hi)
    k_max = (args.max_seq_len - 1 - r) // p
    k_ex = example_count(k_max)
    example = (torch.zeros(BATCH, 1, dtype=torch.long, device=dev), torch.empty(k_ex, 0, device=dev), caches)
    shapes = {"ids": None, "marker": {0: Dim.AUTO(min=1, max=k_max)}, "caches": [None] * len(caches)}
    ep = torch.export.export(DecodeStep(model, p, r), example, dynamic_shapes=shapes, strict=True)
    return ep, _dim_range(ep, "marker", 0, p, r)


def code_digest(package: Path) -> str:
    """sha256 of what a package runs, stable across exports: its generated C++ sources and their
    metadata, without the build-command comments AOTInductor appends (they name temp paths). The
    package file itself is not byte-stable: the compiled library differs from build to build."""
    h = hashlib.sha256()
    with zipfile.ZipFile(package) as z:
        for name in sorted(z.namelist()):
            if name.endswith((".cpp", "_metadata.json")):
                text = z.read(name).decode("utf-8", "replace").split("\n// Compile cmd\n")[0].rstrip()
                h.update(name.split("/")[-1].encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def _custom_ops(package: Path) -> list[str]:
    """dsv41c:: ops a package calls (AOTInductor records non-aten ops for its proxy executor)."""
    import re
    found = set()
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            if name.endswith((".json", ".cpp")):
                found |= set(re.findall(rb"dsv41c::(\w+)", z.read(name)))
    return sorted(op.decode() for op in found)


class WeightStore:
    """Tensors by content: `add` returns the name of an equal tensor already held, else holds this
    one under `name` (made unique). `add_storage` adds a tensor's whole storage, once per storage."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_digest: dict[str, str] = {}
        # (storage address, device, dtype) -> (a view holding the storage alive, its stored name):
        # the prefill's and decode's packages share most constants, which are then neither copied
        # to the CPU nor hashed a second time (held, so an address cannot be reused meanwhile)
        self._by_storage: dict[tuple, tuple[torch.Tensor, str]] = {}

    def add(self, name: str, t: torch.Tensor) -> str:
        digest = hashlib.sha256(str(t.dtype).encode() + t.view(torch.uint8).numpy().data).hexdigest()
        if digest not in self._by_digest:
            key, n = name, 0
            while key in self.tensors:
                n += 1
                key = f"{name}.{n}"
            self.tensors[key] = t
            self._by_digest[digest] = key
        return self._by_digest[digest]

    def add_storage(self, name: str, t: torch.Tensor) -> str:
        """The stored name of `t`'s whole storage, as a flat tensor on the CPU."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device, t.dtype)
        if key not in self._by_storage:
            flat = torch.empty(0, dtype=t.dtype, device=t.device)
            flat.set_(storage, 0, (storage.nbytes() // t.element_size(),))
            self._by_storage[key] = flat, self.add(name, flat.cpu())
        return self._by_storage[key][1]


def compile_package(ep: torch.export.ExportedProgram, package: Path, options: dict[str, Any],
                    store: WeightStore) -> dict[str, list]:
    """AOTInductor-compile `ep` into the package file `package`, code only, and put its constants'
    storages into `store` (`WeightStore.add_storage`). Returns the package's constants as
    name -> [stored tensor, shape, stride, offset].

    These are the steps of `torch._inductor.aoti_compile_and_package` (`aot_compile` with packaging
    on, then `package_aoti`), except that the constants AOTInductor hands back (with
    `package_constants_on_disk_format="pickle_weights"`, one `Weights` entry in its file list) go
    straight to the store instead of being pickled into the package and read back out of it: for
    bench.json on an H200 that round trip was a minute and a half of pickling per package before
    any reading."""
    from torch._inductor.package import package_aoti
    from torch.export.pt2_archive._package_weights import Weights

    args, kwargs = ep.example_inputs
    files = torch._inductor.aot_compile(ep.module(check_guards=False), args, kwargs,
                                        options={**options, "aot_inductor.package": True})
    found = [f for f in files if isinstance(f, Weights)]
    if len(found) != 1:
        raise ArtifactError(f"{package.name}: expected the constants from AOTInductor once, found {len(found)} sets")
    package_aoti(str(package), [f for f in files if not isinstance(f, Weights)])
    constants = {}
    for name, (t, props) in found[0].items():
        if tuple(t.shape) != tuple(props.shape) or tuple(t.stride()) != tuple(props.stride):
            raise ArtifactError(f"{package.name}: constant {name!r}: AOTInductor's value has shape {tuple(t.shape)} "
                                f"and strides {t.stride()}, its graph {tuple(props.shape)} and {tuple(props.stride)}")
        constants[name] = [store.add_storage(name, t), list(t.shape), list(t.stride()), t.storage_offset()]
    return constants


@contextlib.contextmanager
def pipeline_installed(model: Transformer, names: Sequence[str], strict: bool):
    """(pipeline, Inductor options) for an AOTInductor compile of `model` with the pass pipeline
    `names`, as `dsv41c.compile` runs it, while the block runs (grad off). The pipeline is installed
    by config.patch, not passed in the options: AOTInductor deep-copies those, and the copy's
    statistics would be lost. No FX graph cache: a hit would skip the passes."""
    pipeline = build_pipeline(names, strict)
    pipeline.bind(model)
    options = inductor_options(pipeline)
    hook = options.pop("post_grad_custom_post_pass")
    options.update(fx_graph_cache=False, **CPP_WRAPPER_WORKAROUNDS)
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=hook):
        yield pipeline, options


def _short_len(specs: list[ProgramSpec], bounds: dict) -> int:
    """The longest prompt below the prefill program's range that the artifact runs a token at a
    time (0 if none)."""
    lo = min(s.lo for s in specs if s.phase == "prefill")
    return lo - 1 if bounds["prompt_len"][0] < lo else 0


def _last_words(proc: subprocess.CompletedProcess) -> str:
    """The last non-empty lines a failed child process wrote to stderr."""
    return "\n".join([line for line in proc.stderr.strip().splitlines() if line.strip()][-6:])


def check_out_dir(path: Path, option: str = "--out") -> None:
    """An output directory (named by its CLI option in errors) must be new or empty, under an
    existing, writable parent: checked before long work, so a bad path fails at once."""
    parent = path.absolute().parent
    if not parent.is_dir():
        raise InputError(f"{option} {path}: the parent directory {parent} does not exist")
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise InputError(f"{option} {path}: expected a new or empty directory, found "
                         f"{'a non-empty directory' if path.is_dir() else 'a file'}")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option} {path}: the parent directory {parent} is not writable")


@contextlib.contextmanager
def built_in_place(path: Path):
    """A temp directory beside `path` (new or empty: see `check_out_dir`) to build it in: renamed to
    `path` when the block ends, removed when it raises, so `path` is complete or absent."""
    tmp = Path(tempfile.mkdtemp(dir=path.absolute().parent, prefix=f".{path.name}."))
    try:
        yield tmp
        tmp.chmod(0o755)
        if path.is_dir():
            path.rmdir()                        # empty (checked): replaced by the complete one
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(model: Transformer, out: str | os.PathLike, passes: Sequence[str] | None = DEFAULT_PASSES,
           strict: bool = False, *, max_prompt_len: int | None = None, short_prompts: bool = False,
           source: dict | None = None, on_stage: Callable[[str], None] | None = None) -> Path:
    """Export `model` to the artifact directory `out` (new or empty), built in a temp directory
    beside it and renamed into place: `out` is complete or absent. The packages are compiled for
    the model's device (CPU, or the CUDA device it is on) and load only on such a device.

    passes: the pass pipeline, as for `dsv41c.compile` (strict: a pass that matches nothing is an
    error); max_prompt_len: the largest prompt the prefill accepts (default max_seq_len);
    short_prompts: also export a static one-token program at each position below the decode
    program's range (`short_step_specs`; a compile each), so that prompts of any length run and
    decoding may start anywhere (without them, prompts start at the prefill program's range); source:
    where the weights came from, recorded in the manifest; on_stage: called with a description at
    the start of each stage (progress display). Returns the artifact's path.
    """
    out = Path(out)
    check_out_dir(out)
    target = target_of(model.device)
    args = model.args
    max_prompt_len = args.max_seq_len if max_prompt_len is None else max_prompt_len
    if not 1 <= max_prompt_len <= args.max_seq_len:
        raise InputError(f"max_prompt_len: expected 1..max_seq_len={args.max_seq_len}, found {max_prompt_len}")
    stage = on_stage or (lambda _: None)
    names = list(passes or ())
    specs = program_specs()
    # bound before tracing: a pass may change what the model holds (fp4_kv: packed caches)
    build_pipeline(names, strict).bind(model)
    caches = [b.detach().clone() for n, b in model.named_buffers() if n.startswith(CACHE_PREFIX)]
    weights = WeightStore()
    # the experts' grouped GEMMs opaque where the device's C shims lack `_grouped_mm` (tracing one GEMM
    # per expert instead, as before, gave the prefill an unbacked size per expert and layer, nearly
    # twice the graph and twice the AOTInductor compile time (BENCHMARKS.md), and a package that
    # synchronised with the host on every expert)
    with opaque_grouped_mm(experts_without_shim(model)), built_in_place(out) as tmp:
        custom_ops: set[str] = set()
        uuid = build_pipeline(names, strict).uuid()
        pending = list(specs)
        with export_leftovers_dropped():
            while pending:
                spec = pending.pop(0)
                stage(f"torch.export of {spec.file}")
                with torch.no_grad():
                    ep, (spec.lo, spec.hi) = _export_program(model, spec, caches, max_prompt_len)
                stage(f"AOTInductor compile of {spec.file}")
                with pipeline_installed(model, names, strict) as (pipeline, options), unwrapped():
                    spec.constants = compile_package(ep, tmp / spec.file, {**options, **WEIGHTS_OUTSIDE}, weights)
                spec.pass_matches = {s.name: s.matches for s in pipeline.stats.values()}
                spec.code_sha256 = code_digest(tmp / spec.file)
                custom_ops |= set(_custom_ops(tmp / spec.file))
                if short_prompts and spec.phase == "decode" and not spec.static:   # its range is known now
                    steps = short_step_specs(spec.lo)
                    specs += steps
                    pending += steps
        del ep, caches  # device copies of the weights and caches, not needed by the check
        stage(f"writing {WEIGHTS_FILE}, the tokenizer and the manifest")
        safetensors.torch.save_file(weights.tensors, str(tmp / WEIGHTS_FILE))
        # safetensors writes the file owner-only; give it the packages' mode (the umask's), so that
        # whoever may read the packages may read their weights
        (tmp / WEIGHTS_FILE).chmod((tmp / specs[0].file).stat().st_mode & 0o777)
        del weights
        model.tokenizer.backend.save(str(tmp / TOKENIZER_FILE))
        manifest = _manifest(model, specs, names, strict, uuid, sorted(custom_ops), source, target, tmp)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        stage("checking the artifact against the model, loaded in a fresh process")
        manifest["check"] = check_artifact(tmp, model, manifest["bounds"], check_bound(model, names),
                                           short_len=_short_len(specs, manifest["bounds"]))
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out


# The loader's side of `check_packages_load`: argv = root, device index, custom ops (comma-separated), files.
_LOAD_CHECK = """
import sys
from pathlib import Path
import torch
from dsv41c.export import _register_custom_ops, share_libstdcxx
root, index, ops, files = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
_register_custom_ops(root, [op for op in ops.split(",") if op])
share_libstdcxx()
for f in files:
    print(f, flush=True)
    torch._inductor.aoti_load_package(str(root / f), device_index=index)
"""


def check_packages_load(root: Path, files: list[str], custom_ops: list[str], device: torch.device) -> None:
    """Load each package (its compiled library, without constants) in a new interpreter, so that a
    package which crashes the loader fails the export with a message naming it, instead of being
    shipped (`check_artifact` runs this when its own fresh process fails). Seen
    on an H200 with torch 2.11: CUDA packages segfaulted inside AOTInductor's package loader
    (`AOTIModelPackageLoader`) when their library carried its own libstdc++ (`share_libstdcxx`,
    which this check and `load_artifact` now call, is the cure for that one)."""
    index = device.index if device.type == "cuda" and device.index is not None else -1
    cmd = [sys.executable, "-X", "faulthandler", "-c", _LOAD_CHECK, str(root), str(index), ",".join(custom_ops), *files]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if proc.returncode == 0:
        return
    reached = proc.stdout.split()
    culprit = reached[-1] if reached else files[0]
    status = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
              else f"exit status {proc.returncode}")
    raise ArtifactError(f"export: AOTInductor's loader fails on the package {culprit} it built ({status}); "
                        f"nothing was written. torch {torch.__version__}, {target_of(device)}. Its last "
                        f"words:\n" + _last_words(proc))


CHECK_PROMPT_LEN = 24          # the check's prompt, if the bounds allow (else the nearest length they do)
CHECK_LONG_PROMPT_MAX = 4096   # the check's second prompt: the prefill's traced length (`example_count`), at most this

# The user's side of `check_artifact`: argv = artifact, a torch.save file with the prompt ("ids"), the
# decode step's token ("next", optional) and the second prompt ("example", optional), replaced by the logits.
_RUN_CHECK = """
import sys
import torch
from dsv41c.export import load_artifact
root, io = sys.argv[1], sys.argv[2]
given = torch.load(io)
artifact = load_artifact(root)
ids = given["ids"].to(artifact.device)
out = {"prefill": artifact(ids, 0).float().cpu()}
if "next" in given:
    out["decode"] = artifact(given["next"].to(artifact.device), ids.shape[1]).float().cpu()
if "example" in given:
    artifact.reset_cache()
    out["prefill_example"] = artifact(given["example"].to(artifact.device), 0).float().cpu()
if "short" in given:
    artifact.reset_cache()
    out["prefill_short"] = artifact(given["short"].to(artifact.device), 0).float().cpu()
torch.save(out, io)
"""


BF16_CHECK_BOUND = 0.1


def check_bound(model: Transformer, passes: Sequence[str]) -> float:
    """The largest relative max-abs error allowed between the artifact's logits and the eager
    model's: DESIGN.md's 1e-4 for fp32 and 1e-3 with fp4_kv's packed caches. For bf16 the design
    bounds each bf16 program against its fp32 twin (2e-2), which the check does not have. Two bf16
    programs of one function can lie farther apart than that: 3.4% between a CPU artifact and eager
    for tiny's first four layers before the compile rounded where eager does (`compiler.PRECISION`;
    now 0 there on the CPU; 0.3% for all of tiny and 1.1% for bench.json's topology at tiny's widths,
    from Inductor's fp32 softmax, see `compiler.PRECISION`; GPU libraries also pick their own GEMM
    reductions), and eager bf16 alone is 2.6% from fp32 on bench.json on an H200. So the check takes
    0.1, a tenth of the logits' scale: it passes rounding and still refuses a different function (80%
    for bench.json's H200 artifact of 2026-12-01)."""
    if model.dtype == torch.bfloat16:
        return BF16_CHECK_BOUND
    return QUANT_RUNNER_BOUND if "fp4_kv" in passes else RUNNER_BOUND


@contextlib.contextmanager
def export_leftovers_dropped():
    """What an export leaves behind in torch's module state, dropped when the block ends (torch
    2.11). Each piece reaches the traced modules or the compiled graph's constants, which are the
    model's own tensors: left there, they would keep the model's memory alive after the model is
    gone.
    - Strict torch.export's graph capture installs each captured graph's callable as a
      `__compiled_fn_*` global of `torch._dynamo.functional_export` and does not remove it.
    - The tracer's fake-tensor-to-node map (`_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT`, cleared
      when a trace starts) keeps the last trace's nodes.
    - On a GPU, AOTInductor compiles in two passes: the first loads a Python wrapper module, with
      the graph's constants as its attributes, and runs it to tune the Triton kernels. Inductor
      keeps that module in `sys.modules` and in `PyCodeCache.modules`.
    On the CPU, with the first two dropped, nothing else holds the model's storages at the check
    (tests/test_export.py). The third was found by reading Inductor's code after the GPU test
    failed on an H200 (37 of 91 storages held: the constants AOTInductor uses as they are); its
    drop is tested on the CPU by loading such a module the same way. On an H100 with all three
    dropped, 34 of 90 were still held, each by a Python tensor whose holder was not found in that
    run's time: so `off_the_device` empties the storages instead of relying on these drops."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.compile_tasks import _reload_python_module
    from torch.fx.experimental import proxy_tensor
    loaded = _reload_python_module.__module__ + "."     # the names Inductor gives the modules it loads
    scope = vars(importlib.import_module("torch._dynamo.functional_export"))
    before = set(scope)
    modules_before = set(sys.modules)
    try:
        yield
    finally:
        for name in [n for n in scope if n not in before and n.startswith("__compiled_fn")]:
            del scope[name]
        proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()
        wrappers = [m for n, m in list(sys.modules.items())
                    if n not in modules_before and n.startswith(loaded) and _holds_tensors(m)]
        for mod in wrappers:
            del sys.modules[mod.__name__]
        PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if all(m is not w for w in wrappers)]


def _holds_tensors(module) -> bool:
    """Whether a module's globals hold a tensor (Inductor's wrapper modules hold the constants)."""
    return any(isinstance(v, torch.Tensor) for v in vars(module).values())


@contextlib.contextmanager
def off_the_device(model: nn.Module):
    """A CUDA model's parameters and buffers emptied for the duration (`storages_parked`), and the
    device memory they held returned to the driver, so that the check's fresh process can load the
    artifact's own copy of the weights beside it: the device then holds the weights once, not
    twice. The storages are emptied rather than the model moved, because what the export leaves
    in torch's state may still hold tensors on them (on an H100, with `export_leftovers_dropped`,
    34 of the cut's 90 floating-point storages were still held at the check): moving the model
    would leave those on the device. A model on the CPU stays as it is. The model has its values
    back afterwards, also when the body raises."""
    if next(model.parameters()).device.type != "cuda":
        yield
        return
    with storages_parked([*model.parameters(), *model.buffers()]):
        torch.cuda.empty_cache()
        yield


@contextlib.contextmanager
def storages_parked(tensors):
    """The storages under `tensors` emptied for the duration: each one's bytes copied to a host
    storage and the storage resized to zero bytes, which frees its memory whoever else holds a
    tensor on it; then resized back and refilled, so that every such tensor, the model's or not,
    has its values back (at a new address). A storage that cannot be resized (memory torch does
    not own) stays as it is."""
    parked = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.resizable() and st.data_ptr() not in parked:
            host = torch.UntypedStorage(st.nbytes())
            host.copy_(st)
            parked[st.data_ptr()] = st, host
    for st, _ in parked.values():
        st.resize_(0)
    try:
        yield
    finally:
        for st, host in parked.values():
            st.resize_(host.nbytes())
            st.copy_(host)


def run_check_process(root: Path, io: Path, scratch: str) -> subprocess.CompletedProcess:
    """`_RUN_CHECK` in a fresh interpreter: the artifact at root run on the prompts in io."""
    return subprocess.run([sys.executable, "-c", _RUN_CHECK, str(root), str(io)], capture_output=True, text=True,
                          cwd=scratch)


def check_artifact(root: Path, model: Transformer, bounds: dict, bound: float, short_len: int = 0) -> dict[str, Any]:
    """Load the finished artifact in a fresh process, as a user does (hashes, versions, weights,
    packages), run a seeded prompt and one decode step, then a second prompt at the length the
    prefill was traced and tuned at (the export's example: half the bound; at most
    `CHECK_LONG_PROMPT_MAX`, as eager must run it too), and compare the logits
    with the eager model's (relative max-abs, `bound`). Two lengths far apart: a package can be
    right at one and wrong at the other (an H200 package of bench.json's widths was 0.011 from
    eager at its example's 4096 tokens and 0.67 at 24). Returns what was measured, for the
    manifest; raises ArtifactError past the bound, so a package that computes something else is
    never shipped. With short_len, a third prompt of that many tokens runs a token at a time through
    the static steps and the decode program (`short_step_specs`). While the fresh process runs, a
    CUDA model's storages are emptied, their bytes on the host (`off_the_device`)."""
    lo, hi = bounds["prompt_len"]
    n = min(max(lo, CHECK_PROMPT_LEN), hi)
    n_example = min(max(lo, min(example_count(hi), CHECK_LONG_PROMPT_MAX)), hi)   # the programs have period 1
    ids = torch.randint(0, model.args.vocab_size, (BATCH, n), generator=torch.Generator().manual_seed(0))
    model.reset_cache()
    with torch.no_grad():
        ref = {"prefill": model(ids.to(model.device), 0).float().cpu()}
        given = {"ids": ids}
        d_lo, d_hi = bounds["decode_pos"]
        if d_lo <= n <= d_hi:
            given["next"] = ref["prefill"].argmax(-1, keepdim=True)
            ref["decode"] = model(given["next"].to(model.device), n).float().cpu()
        if n_example != n:
            given["example"] = torch.randint(0, model.args.vocab_size, (BATCH, n_example),
                                             generator=torch.Generator().manual_seed(1))
            model.reset_cache()
            ref["prefill_example"] = model(given["example"].to(model.device), 0).float().cpu()
        if short_len:
            given["short"] = torch.randint(0, model.args.vocab_size, (BATCH, short_len),
                                           generator=torch.Generator().manual_seed(2))
            model.reset_cache()
            ref["prefill_short"] = model(given["short"].to(model.device), 0).float().cpu()
    model.reset_cache()
    with tempfile.TemporaryDirectory() as scratch:
        io = Path(scratch) / "check.pt"
        torch.save(given, io)
        with off_the_device(model):
            proc = run_check_process(root, io, scratch)
        if proc.returncode:
            manifest = json.loads((root / MANIFEST_FILE).read_text(encoding="utf-8"))
            # a package that crashes AOTInductor's loader is named (the check's child cannot say which)
            check_packages_load(root, [p["file"] for p in manifest["programs"]], manifest["custom_ops"], model.device)
            raise ArtifactError("export: the artifact could not be loaded and run in a fresh process; nothing "
                                "was written. Its last words:\n" + _last_words(proc))
        found = torch.load(io)
    errors = {k: relative_error(found[k], ref[k]) for k in ref}
    bad = [k for k, err in errors.items() if not err <= bound]
    if bad:
        each = ", ".join(f"{k} {err:.3g}" for k, err in errors.items())
        raise ArtifactError(f"export: the artifact's {' and '.join(bad)} logits differ from the eager model's "
                            f"({each}; relative max-abs, bound {bound:g}, prompts of "
                            f"{' and '.join(dict.fromkeys(str(k) for k in (n, n_example, short_len) if k))} "
                            f"seeded tokens); nothing was "
                            f"written. torch {torch.__version__}, {target_of(model.device)}")
    return {"prompt_len": n, "example_prompt_len": n_example, **({"short_prompt_len": short_len} if short_len else {}),
            "bound": bound, "relative_error": errors}


def _manifest(model: Transformer, specs: list[ProgramSpec], passes: list[str], strict: bool, uuid: str,
              custom_ops: list[str], source: dict | None, target: dict[str, str], root: Path) -> dict[str, Any]:
    tok = model.tokenizer
    dtype = next(k for k, v in DTYPES.items() if v == model.dtype)
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": model.args.to_dict(),
        "model": {"dtype": dtype, "kv_quant": model.kv_quant, "kv_storage": model.cache.storage,
                  "source": source or {}},
        "passes": {"names": passes, "strict": strict, "uuid": uuid},
        "versions": versions(),
        "device": target,
        "batch": BATCH,
        "bounds": artifact_bounds(specs),
        "programs": [{"file": s.file, "phase": s.phase, "period": s.period, "residue": s.residue,
                      "min": s.lo, "max": s.hi, "pass_matches": s.pass_matches, "code_sha256": s.code_sha256,
                      "constants": s.constants}
                     for s in specs],
        "weights": {"file": WEIGHTS_FILE},
        "custom_ops": custom_ops,
        "cache": [[n, list(b.shape), str(b.dtype).removeprefix("torch.")]
                  for n, b in model.named_buffers() if n.startswith(CACHE_PREFIX)],
        "tokenizer": {"file": TOKENIZER_FILE, "bos_id": tok.bos_id, "pad_id": tok.pad_id, "noise_id": tok.noise_id},
        **file_hashes(root),
    }


# ------------------------------------------------------------------------------ hashes
PIECE = 256 << 20      # a file larger than this is also hashed in pieces of this size


def _sha256_of_range(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0:
            block = f.read(min(length, 8 << 20))
            if not block:
                break
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def _pool_size(jobs: int) -> int:
    return max(1, min(jobs, os.cpu_count() or 1))


def piece_hashes(path: Path, piece: int = PIECE) -> list[str]:
    """sha256 of each `piece`-byte piece of the file (the last one shorter), hashed in parallel
    (hashlib lets go of the GIL while it hashes)."""
    from concurrent.futures import ThreadPoolExecutor
    size = path.stat().st_size
    starts = range(0, size, piece)
    with ThreadPoolExecutor(_pool_size(len(starts))) as pool:
        return list(pool.map(lambda start: _sha256_of_range(path, start, min(piece, size - start)), starts))


def file_hashes(root: Path, piece: int = PIECE) -> dict[str, dict]:
    """The manifest's `files` (name -> sha256 of the whole file, for every file but the manifest)
    and `pieces` (for each file over one piece: its size, the piece size and each piece's sha256).
    The load checks the pieces, in parallel, where they are listed: a weights file of tens of GB
    is then hashed on every core instead of one (about 1 GB/s a core)."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [p for p in sorted(root.iterdir()) if p.name != MANIFEST_FILE]
    big = [p for p in paths if p.stat().st_size > piece]
    with ThreadPoolExecutor(_pool_size(len(paths))) as pool:  # whole files beside the pieces
        whole = {p.name: pool.submit(sha256, p) for p in paths}
        pieces = {p.name: {"size": p.stat().st_size, "piece": piece, "sha256": piece_hashes(p, piece)} for p in big}
        return {"files": {name: f.result() for name, f in whole.items()}, "pieces": pieces}


def check_pieces(path: Path, entry: Any) -> None:
    """A file against its manifest `pieces` entry: its size, then every piece's sha256."""
    if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("piece"), int)
            and entry["piece"] > 0 and isinstance(entry.get("sha256"), list)
            and len(entry["sha256"]) == -(-entry["size"] // entry["piece"])):
        raise ArtifactError(f"{path}: its {MANIFEST_FILE} pieces entry is malformed: {str(entry)[:200]}")
    size = path.stat().st_size
    if size != entry["size"]:
        raise ArtifactError(f"{path}: size mismatch (truncated or tampered): expected {entry['size']} bytes, "
                            f"found {size}")
    found = piece_hashes(path, entry["piece"])
    for i, (want, got) in enumerate(zip(entry["sha256"], found, strict=True)):
        if want != got:
            raise ArtifactError(f"{path}: sha256 mismatch (tampered or corrupted) in bytes "
                                f"{i * entry['piece']}..{min(size, (i + 1) * entry['piece']) - 1}: expected {want}, "
                                f"found {got}")


# ------------------------------------------------------------------------------ load
def _bad(root: Path, what: str) -> ArtifactError:
    return ArtifactError(f"{root / MANIFEST_FILE}: {what}")


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_FILE
    if not root.is_dir():
        raise ArtifactError(f"{root}: expected an artifact directory, found {'a file' if root.exists() else 'nothing'}")
    if not path.is_file():
        raise ArtifactError(f"{path}: missing (not an exported artifact, or an incomplete one)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        hint = "; re-export it with this dsv41c" if isinstance(found, int) and found < FORMAT else ""
        raise _bad(root, f"format: expected {FORMAT}, found {found!r}{hint}")
    for key in ("config", "model", "versions", "programs", "cache", "tokenizer", "files", "bounds"):
        if key not in manifest:
            raise _bad(root, f"key {key!r} missing")
    return manifest


def verify(root: str | os.PathLike) -> dict[str, Any]:
    """Check an artifact before anything in it is loaded: the manifest's form, every listed file
    present with its sha256 (a file listed under `pieces`: its size and each piece's sha256, in
    parallel), no unlisted file, and the versions equal to this process's. Returns the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    files, pieces = manifest["files"], manifest.get("pieces", {})
    if not isinstance(pieces, dict) or not set(pieces) <= set(files):
        raise _bad(root, "pieces: expected an entry per listed file over one piece")
    for name, digest in files.items():
        path = root / name
        if Path(name).name != name or not path.is_file():
            raise ArtifactError(f"{path}: listed in {MANIFEST_FILE} but missing")
        if name in pieces:                      # large: its pieces, hashed in parallel
            check_pieces(path, pieces[name])
            continue
        found = sha256(path)
        if found != digest:
            raise ArtifactError(f"{path}: sha256 mismatch (tampered or corrupted): expected {digest}, found {found}")
    extra = sorted(p.name for p in root.iterdir() if p.name not in files and p.name != MANIFEST_FILE)
    if extra:
        raise ArtifactError(f"{root / extra[0]}: not listed in {MANIFEST_FILE} (files: {sorted(files)})")
    here = versions()
    for key, want in here.items():
        found = manifest["versions"].get(key)
        if found != want:
            raise _bad(root, f"versions.{key}: exported with {found!r}, this process has {want!r}; "
                             "re-export the artifact with this environment")
    listed = {p.get("file") for p in manifest["programs"]}
    if not listed <= set(files):
        raise _bad(root, f"programs: {sorted(listed - set(files))[0]!r} is not among the hashed files")
    return manifest


def _register_custom_ops(root: Path, ops: list[str]) -> None:
    """The packages call our ops through torch.library: import the kernel modules that register them."""
    if not ops:
        return
    import importlib
    for module in ("attention", "indexer", "mhc", "quant"):
        try:
            importlib.import_module(f"dsv41c.tilelang_kernels.{module}")
        except ImportError:
            pass
    missing = [op for op in ops if not hasattr(torch.ops.dsv41c, op)]
    if missing:
        raise _bad(root, f"custom_ops: dsv41c::{missing[0]} is not registered by this dsv41c "
                         f"(expected every one of {ops})")


class Artifact:
    """An exported model, loaded: the call surface of `Transformer.forward` for generation (last
    position's logits [1, V] fp32), with the caches owned here and shared by every program.

    args, tokenizer and manifest are the artifact's; `bounds` (prompt lengths, decode positions)
    are the exported ranges, and a call outside them is an InputError. `load_seconds`: what
    `load_artifact` spent on verifying the hashes, reading the weights and loading each package.
    """

    def __init__(self, root: Path, manifest: dict[str, Any], programs: list[tuple[ProgramSpec, Any]],
                 tokenizer: Tokenizer, weights: dict[str, torch.Tensor], load_seconds: dict[str, float]):
        self.root, self.manifest, self.tokenizer, self.load_seconds = root, manifest, tokenizer, load_seconds
        self.weights = weights      # the packages hold pointers into these tensors (user-managed constants)
        self.args = ModelArgs.from_dict(manifest["config"], source=f"{root / MANIFEST_FILE}: config")
        self.programs = programs
        self.periods = {spec.phase: spec.period for spec, _ in programs}     # decode: 1 (older: per residue)
        # shorter prompts (when the bounds start below it) run a token at a time through the decode steps
        self.prefill_from = min(spec.lo for spec, _ in programs if spec.phase == "prefill")
        self.bounds = {k: tuple(v) for k, v in manifest["bounds"].items()}
        m = manifest["model"]
        if m.get("dtype") not in DTYPES:
            raise _bad(root, f"model.dtype: expected one of {sorted(DTYPES)}, found {m.get('dtype')!r}")
        self.cache = ModelCache(self.args, build_layer_plan(self.args), DTYPES[m["dtype"]],
                                m.get("kv_storage", "plain"))
        found = [[CACHE_PREFIX + n, list(b.shape), str(b.dtype).removeprefix("torch.")]
                 for n, b in self.cache.named_buffers()]
        if found != manifest["cache"]:
            raise _bad(root, f"cache: the packages expect {manifest['cache']}, this dsv41c builds {found}")
        self._device = torch.device(manifest["device"]["type"])
        self.cache.to(self._device)
        self.caches = [b for _, b in self.cache.named_buffers()]
        self.reset_cache()

    @property
    def device(self) -> torch.device:
        return self._device

    def reset_cache(self) -> None:
        self.cache.reset()

    def check_generation(self, prompt_len: int, max_new_tokens: int) -> None:
        """The prompt and every decode position must lie within the exported bounds."""
        lo, hi = self.bounds["prompt_len"]
        if not lo <= prompt_len <= hi:
            raise self._outside("prefill", f"prompt of {prompt_len} tokens", prompt_len)
        last = prompt_len + max_new_tokens - 2                     # the last decode step's position
        if max_new_tokens > 1:
            lo, hi = self.bounds["decode_pos"]
            if prompt_len < lo or last > hi:
                raise self._outside("decode", f"decode positions {prompt_len}..{last}",
                                    prompt_len if prompt_len < lo else last)

    def _outside(self, phase: str, what: str, t: int) -> InputError:
        """The error for a length or position t outside the phase's bounds, with what can be done."""
        lo, hi = self.bounds["prompt_len" if phase == "prefill" else "decode_pos"]
        if t < lo:      # torch.export's 0/1 specialisation and the model's shape branches (module docstring)
            why = (f"torch.export settled the model's shape branches from {lo} on; export with --short-prompts, "
                   f"or use dsv41c.compile, for any {'length' if phase == 'prefill' else 'position'}")
        elif phase == "prefill" and hi < self.args.max_seq_len:
            why = f"export again with a larger --max-prompt-len, at most max_seq_len {self.args.max_seq_len}"
        else:
            why = f"the model's max_seq_len is {self.args.max_seq_len}"
        return InputError(f"{what}: outside the exported {phase} bounds {lo}..{hi} of {self.root} ({why})")

    def _program(self, phase: str, t: int):
        for spec, runner in self.programs:
            if spec.phase == phase and spec.covers(t):
                return runner
        raise self._outside(phase, f"prompt of {t} tokens" if phase == "prefill" else f"decode at position {t}", t)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise InputError(f"input_ids: expected an int64 tensor [1, S], found "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        b, s = input_ids.shape
        if b != BATCH:
            raise InputError(f"input_ids: the artifact is exported for batch {BATCH}, found batch {b}")
        check_token_range(input_ids, start_pos, self.args.vocab_size)
        input_ids = input_ids.to(self._device)
        if start_pos == 0 and self.bounds["prompt_len"][0] <= s < self.prefill_from:
            for pos in range(s):                      # the static steps, then the decode program
                out = self._program("decode", pos)(input_ids[:, pos:pos + 1],
                                                    decode_marker(pos, self.periods["decode"], input_ids.device),
                                                    self.caches)
            return out
        if start_pos == 0:
            run = self._program("prefill", s)
            return run(*prefill_inputs(input_ids, self.periods["prefill"]), self.caches)
        if s != 1:
            raise InputError(f"start_pos={start_pos} with {s} tokens: calls are a prefill (start_pos=0) "
                             "or a one-token decode step (start_pos>0)")
        run = self._program("decode", start_pos)
        return run(input_ids, decode_marker(start_pos, self.periods["decode"], input_ids.device), self.caches)


def _check_device(root: Path, target) -> None:
    """The packages run only on the kind of device they were compiled for (CUDA: the same arch)."""
    if not isinstance(target, dict) or target.get("type") not in ("cpu", "cuda"):
        raise _bad(root, f"device: expected {{'type': 'cpu' | 'cuda', ...}}, found {target!r}")
    if target["type"] == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError(f"{root}: exported for CUDA ({target.get('name')}, {target.get('arch')}); "
                                "this process has no CUDA device (re-export on CPU to run here)")
        here = target_of(torch.device("cuda"))
        if here["arch"] != target.get("arch"):
            raise ArtifactError(f"{root}: exported for {target.get('arch')} ({target.get('name')}); this "
                                f"device is {here['arch']} ({here['name']}): re-export on it")


def share_libstdcxx() -> None:
    """Make the libstdc++ this process has loaded global (RTLD_GLOBAL), before loading a package.

    A compiler that links libstdc++ statically into the package's library (seen on an H200 host:
    a relocated GCC 13 whose driver finds only libstdc++.a) leaves a second copy of libstdc++ in it,
    with its symbols exported. Python loads torch's libraries RTLD_LOCAL, so libstdc++.so.6 is not
    in the global scope, and the package's library binds some of its libstdc++ references to its own
    copy and others to libstdc++.so.6: the two disagree on the locale's facet registry, and the first
    std::regex (AOTInductor's CUDA model constructor parses the device string with one) dies:
    SIGSEGV in `AOTIModelPackageLoader` on the H200 with torch 2.11. With libstdc++.so.6 global,
    every reference binds to it. A process without libstdc++.so.6 loaded has nothing to share."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError:
        pass


def load_artifact(path: str | os.PathLike) -> Artifact:
    """Verify an exported artifact (hashes, versions, custom ops) and load its packages; nothing
    is compiled. Raises ArtifactError naming the file and what is wrong."""
    root = Path(path)
    t0 = time.perf_counter()
    manifest = verify(root)
    seconds = {"verify": time.perf_counter() - t0}
    _check_device(root, manifest.get("device"))
    _register_custom_ops(root, list(manifest.get("custom_ops", [])))
    tok = manifest["tokenizer"]
    tokenizer = Tokenizer.from_file(root / tok["file"], bos_id=tok.get("bos_id"), pad_id=tok.get("pad_id"),
                                    noise_id=tok.get("noise_id"))
    t0 = time.perf_counter()
    weights = _load_weights(root, manifest)
    seconds["weights"] = time.perf_counter() - t0
    share_libstdcxx()
    programs = []
    for p in manifest["programs"]:
        t0 = time.perf_counter()
        spec = ProgramSpec(p["phase"], p["period"], p["residue"], p["file"], p["min"], p["max"], p.get("pass_matches"),
                           constants=p.get("constants"))
        try:
            runner = torch._inductor.aoti_load_package(str(root / spec.file))
        except Exception as e:       # a hashed file that still fails to load: a foreign torch build
            raise ArtifactError(f"{root / spec.file}: AOTInductor could not load the package ({e})") from None
        _bind_constants(root, spec, runner, weights)
        programs.append((spec, runner))
        seconds[spec.file] = time.perf_counter() - t0
    if not programs:
        raise _bad(root, "programs: empty")
    return Artifact(root, manifest, programs, tokenizer, weights, seconds)


def _load_weights(root: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The stored tensors, once, on the packages' device."""
    name = (manifest.get("weights") or {}).get("file")
    if name not in manifest["files"]:
        raise _bad(root, f"weights.file: {name!r} is not among the hashed files")
    device = manifest["device"]["type"]
    try:
        return safetensors.torch.load_file(str(root / name), device=device)
    except Exception as e:
        raise ArtifactError(f"{root / name}: could not be read as safetensors ({e})") from None


def _bind_constants(root: Path, spec: ProgramSpec, runner, weights: dict[str, torch.Tensor]) -> None:
    """Give a package its constants: views of the shared stored tensors, as the manifest lists them."""
    if not isinstance(spec.constants, dict):
        raise _bad(root, f"programs: {spec.file} lists no constants")
    views = {}
    for const, entry in spec.constants.items():
        if not (isinstance(entry, list) and len(entry) == 4 and entry[0] in weights):
            raise _bad(root, f"programs: {spec.file} constant {const!r} -> {entry!r}: not a stored tensor "
                             f"[name, shape, stride, offset]")
        key, shape, stride, offset = entry
        base = weights[key]
        try:
            empty = any(n == 0 for n in shape)
            if not empty and offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) >= base.numel():
                raise ValueError(f"reaches past {key!r} ({base.numel()} elements)")
            views[const] = base.as_strided(shape, stride, offset)
        except (TypeError, ValueError, RuntimeError) as e:
            raise _bad(root, f"programs: {spec.file} constant {const!r} -> {entry!r}: {e}") from None
    expected = set(runner.get_constant_fqns())
    if set(views) != expected:
        extra = sorted(expected ^ set(views))
        raise _bad(root, f"programs: {spec.file} constants differ from the package's ({extra[0]!r} and "
                         f"{len(extra) - 1} more)")
    try:
        runner.load_constants(views, check_full_update=True, user_managed=True)
    except Exception as e:
        raise ArtifactError(f"{root / spec.file}: its constants could not be loaded ({e})") from None
