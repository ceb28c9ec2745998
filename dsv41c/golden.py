"""Golden regression: record the eager model's outputs once, then hold every later run to them.

A golden file (`golden/<config-stem>.safetensors`) is self-contained: it stores the config JSON
and its sha256 in the safetensors metadata, the seed of the random weights and of the inputs, and
the tensors

    inputs          [B, S]      int64  prompt ids
    prefill_logits  [B, S, V]   fp32   model(inputs, start_pos=0, full_logits=True)
    decode_tokens   [B, N]      int64  the token fed at decode step i (greedy choice before it)
    decode_logits   [B, N, V]   fp32   model(decode_tokens[:, i:i+1], start_pos=S+i)

The model is float32 with kv_quant=False (the unquantised reference the compiled program without
quantising passes is held to; see DESIGN.md). `check` replays the inputs with
teacher forcing (the recorded tokens are fed back, so one early divergence does not cascade) and
compares eager against the file, and a pluggable runner (e.g. `dsv41c.compile(model)`) against
eager, with the bounds of DESIGN.md. Runs on CPU in a few seconds for the tiny configs.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import dsv41c
from dsv41c.config import ModelArgs
from dsv41c.errors import ConfigError, GoldenMismatch, InputError
from dsv41c.model import Transformer
from dsv41c.weights import build_model

FORMAT_VERSION = "1"
MANIFEST = "manifest.json"
GOLDEN_BOUND = 1e-5          # eager fp32 vs recorded golden
RUNNER_BOUND = 1e-4          # compiled (no quantising passes) vs eager fp32
QUANT_RUNNER_BOUND = 1e-3    # fp4_kv compiled vs eager with kv_quant=True
# fp32 without the KV fake quantisers: their rounding steps turn 1-ulp reorderings (which a compiler
# may legitimately make) into large logit changes, so they would defeat the 1e-4 compiled bound.
DTYPE, KV_QUANT = torch.float32, False
TENSORS = ("inputs", "prefill_logits", "decode_tokens", "decode_logits")
METADATA = ("format", "dsv41c_golden", "config_name", "config_json", "config_sha256", "seed", "dtype",
            "kv_quant", "prompt_len", "decode_steps", "batch", "torch_version", "dsv41c_version", "date")

Runner = Callable[..., torch.Tensor]


# ------------------------------------------------------------------------------ config identity
def canonical_config(args: ModelArgs) -> str:
    return json.dumps(args.to_dict(), sort_keys=True, separators=(",", ":"))


def config_sha256(args: ModelArgs) -> str:
    return hashlib.sha256(canonical_config(args).encode()).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_prompt_len(args: ModelArgs) -> int:
    """Three windows plus one: the rings wrap, the prefill ends inside a ratio-2 group, and the
    compressed caches hold more entries than index_topk for the tiny configs."""
    return 3 * args.window_size + 1


# ------------------------------------------------------------------------------ running
@dataclass
class Trace:
    """What one replay produced: prefill logits [B,S,V] and each decode step's logits [B,N,V]."""
    prefill_logits: torch.Tensor
    decode_logits: torch.Tensor


def greedy_choices(trace: Trace) -> torch.Tensor:
    """[B, N+1]: the argmax before each decode step, then the argmax after the last one."""
    before = torch.cat([trace.prefill_logits[:, -1:], trace.decode_logits], dim=1)
    return before.argmax(dim=-1)


@torch.no_grad()
def run_greedy(model: Runner, inputs: torch.Tensor, steps: int) -> tuple[Trace, torch.Tensor]:
    """Prefill, then `steps` greedy decode steps (each step's argmax fed back)."""
    prefill = model(inputs, start_pos=0, full_logits=True).float()
    token = prefill[:, -1].argmax(dim=-1, keepdim=True)
    tokens, logits = [], []
    for i in range(steps):
        tokens.append(token)
        out = model(token, start_pos=inputs.shape[1] + i).float()
        logits.append(out)
        token = out.argmax(dim=-1, keepdim=True)
    return Trace(prefill, _stack(logits, prefill)), _cat_tokens(tokens, inputs)


@torch.no_grad()
def run_teacher_forced(model: Runner, inputs: torch.Tensor, tokens: torch.Tensor) -> Trace:
    """Prefill, then one decode step per recorded token, whatever the model would have chosen."""
    reset = getattr(model, "reset_cache", None)
    if callable(reset):
        reset()
    b, s = inputs.shape
    prefill = _checked(model(inputs, start_pos=0, full_logits=True), (b, s, None), "the prefill")
    v = prefill.shape[-1]
    logits = [_checked(model(tokens[:, i:i + 1], start_pos=s + i), (b, v), f"decode step {i}")
              for i in range(tokens.shape[1])]
    return Trace(prefill, _stack(logits, prefill))


def _checked(out: Any, shape: tuple[int | None, ...], what: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(out.shape, shape)):
        found = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        expected = tuple("V" if d is None else d for d in shape)
        raise InputError(f"runner output of {what}: expected logits of shape {expected}, found {found}")
    return out.float()


def _stack(logits: list[torch.Tensor], prefill: torch.Tensor) -> torch.Tensor:
    if not logits:
        return prefill.new_zeros(prefill.shape[0], 0, prefill.shape[-1])
    return torch.stack(logits, dim=1)


def _cat_tokens(tokens: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    return torch.cat(tokens, dim=1) if tokens else inputs.new_zeros(inputs.shape[0], 0)


@contextmanager
def _no_tf32() -> Iterator[None]:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# ------------------------------------------------------------------------------ record
def make_inputs(args: ModelArgs, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (batch, prompt_len), generator=gen, dtype=torch.int64)


def record(config_path: str | os.PathLike, out_dir: str | os.PathLike = "golden", seed: int = 0,
           prompt_len: int | None = None, decode_steps: int = 16, batch: int = 2) -> Path:
    """Record `<out_dir>/<config-stem>.safetensors` from the eager fp32 model (kv_quant=False).

    prompt_len defaults to `default_prompt_len(args)`. The write is atomic (temp file, rename).
    """
    config_path = Path(config_path)
    args = ModelArgs.from_json(config_path)
    prompt_len = default_prompt_len(args) if prompt_len is None else prompt_len
    for name, value, lo in (("prompt_len", prompt_len, 1), ("decode_steps", decode_steps, 1), ("batch", batch, 1)):
        if value < lo:
            raise InputError(f"{name}: expected >= {lo}, found {value}")
    if batch > args.max_batch_size:
        raise InputError(f"batch: {batch} exceeds max_batch_size={args.max_batch_size} of {config_path}")
    if prompt_len + decode_steps > args.max_seq_len:
        raise InputError(f"prompt_len + decode_steps: {prompt_len} + {decode_steps} exceeds max_seq_len="
                         f"{args.max_seq_len} of {config_path}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: expected a directory for the golden files, found a file")
    out_dir.mkdir(parents=True, exist_ok=True)

    model = build_model(args, seed=seed, dtype=DTYPE, kv_quant=KV_QUANT)
    inputs = make_inputs(args, batch, prompt_len, seed)
    with _no_tf32():
        trace, tokens = run_greedy(model, inputs, decode_steps)
    tensors = {"inputs": inputs, "prefill_logits": trace.prefill_logits, "decode_tokens": tokens,
               "decode_logits": trace.decode_logits}
    metadata = {
        "format": "pt", "dsv41c_golden": FORMAT_VERSION, "config_name": config_path.stem,
        "config_json": canonical_config(args), "config_sha256": config_sha256(args), "seed": str(seed),
        "dtype": "float32", "kv_quant": str(KV_QUANT).lower(), "prompt_len": str(prompt_len),
        "decode_steps": str(decode_steps), "batch": str(batch), "torch_version": torch.__version__,
        "dsv41c_version": dsv41c.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    }
    path = out_dir / f"{config_path.stem}.safetensors"
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return path


def _atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)         # mkstemp makes 0600; a golden file is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(out_dir: str | os.PathLike, entries: dict[str, dict[str, Any]]) -> Path:
    """Merge `entries` (file name -> fields) into `<out_dir>/manifest.json`, atomically."""
    path = Path(out_dir) / MANIFEST
    manifest = read_manifest(out_dir) if path.is_file() else {"format": FORMAT_VERSION, "files": {}}
    manifest["files"].update(entries)
    manifest["files"] = dict(sorted(manifest["files"].items()))
    text = json.dumps(manifest, indent=2) + "\n"
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def manifest_entry(golden_file: Path, config_path: Path) -> dict[str, Any]:
    golden = load_golden(golden_file)
    meta = golden.metadata
    return {"sha256": file_sha256(golden_file), "config": config_path.as_posix(),
            "config_name": meta["config_name"], "config_sha256": meta["config_sha256"],
            "prompt_len": int(meta["prompt_len"]), "decode_steps": int(meta["decode_steps"]),
            "batch": int(meta["batch"]), "seed": int(meta["seed"]), "dtype": meta["dtype"],
            "kv_quant": meta["kv_quant"] == "true", "date": meta["date"]}


def read_manifest(golden_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(golden_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: golden manifest not found (run `dsv41c golden record`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InputError(f"{path}: expected an object with a 'files' object, found {type(manifest).__name__}")
    return manifest


def golden_files(golden_dir: str | os.PathLike) -> list[Path]:
    """The files the manifest lists, each checked against its recorded sha256."""
    golden_dir = Path(golden_dir)
    if not golden_dir.is_dir():
        raise InputError(f"{golden_dir}: expected a golden directory, found "
                         f"{'a file' if golden_dir.exists() else 'nothing'}")
    manifest = read_manifest(golden_dir)
    if not manifest["files"]:
        raise InputError(f"{golden_dir / MANIFEST}: lists no golden files")
    paths = []
    for name, entry in manifest["files"].items():
        path = golden_dir / name
        if not path.is_file():
            raise InputError(f"{golden_dir / MANIFEST}: lists {name}, but {path} does not exist")
        found = file_sha256(path)
        if found != entry.get("sha256"):
            raise InputError(f"{path}: sha256 {found} differs from the manifest's {entry.get('sha256')} "
                             "(re-record with `dsv41c golden record`)")
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------ load
@dataclass
class Golden:
    path: Path
    args: ModelArgs
    metadata: dict[str, str]
    inputs: torch.Tensor
    prefill_logits: torch.Tensor
    decode_tokens: torch.Tensor
    decode_logits: torch.Tensor

    @property
    def name(self) -> str:
        return self.metadata["config_name"]

    @property
    def seed(self) -> int:
        return int(self.metadata["seed"])

    @property
    def prompt_len(self) -> int:
        return self.inputs.shape[1]

    @property
    def trace(self) -> Trace:
        return Trace(self.prefill_logits, self.decode_logits)

    def build_model(self, device: str | torch.device = "cpu") -> Transformer:
        return build_model(self.args, seed=self.seed, dtype=DTYPE, kv_quant=KV_QUANT, device=device)


def load_golden(path: str | os.PathLike) -> Golden:
    """Read and validate a golden file: metadata keys, config hash, tensor names, dtypes, shapes."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: golden file not found")
    try:
        with safe_open(path, framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    for key in METADATA:
        if key not in metadata:
            raise InputError(f"{path}: metadata key {key!r} missing (not a dsv41c golden file?)")
    if metadata["dsv41c_golden"] != FORMAT_VERSION:
        raise InputError(f"{path}: golden format {metadata['dsv41c_golden']!r}, expected {FORMAT_VERSION!r}")
    if (metadata["dtype"], metadata["kv_quant"]) != ("float32", str(KV_QUANT).lower()):
        raise InputError(f"{path}: recorded with dtype={metadata['dtype']} kv_quant={metadata['kv_quant']}, "
                         f"expected float32 with kv_quant={str(KV_QUANT).lower()}")
    try:
        raw = json.loads(metadata["config_json"])
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: metadata config_json is not valid JSON ({e})") from None
    args = ModelArgs.from_dict(raw, source=f"{path} (config_json)")
    found = config_sha256(args)
    if found != metadata["config_sha256"]:
        raise ConfigError(f"{path}: the stored config hashes to sha256 {found}, but the metadata "
                          f"config_sha256 is {metadata['config_sha256']}")
    for name in TENSORS:
        if name not in tensors:
            raise InputError(f"{path}: tensor {name!r} missing")
    inputs, prefill = tensors["inputs"], tensors["prefill_logits"]
    tokens, decode = tensors["decode_tokens"], tensors["decode_logits"]
    b, s = inputs.shape if inputs.dim() == 2 else (-1, -1)
    n, v = int(metadata["decode_steps"]), args.vocab_size
    expected = {"inputs": ((b, s), torch.int64), "prefill_logits": ((b, s, v), torch.float32),
                "decode_tokens": ((b, n), torch.int64), "decode_logits": ((b, n, v), torch.float32)}
    if inputs.dim() != 2 or (b, s) != (int(metadata["batch"]), int(metadata["prompt_len"])):
        raise InputError(f"{path}: tensor 'inputs' has shape {tuple(inputs.shape)}, expected "
                         f"({metadata['batch']}, {metadata['prompt_len']})")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise InputError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    return Golden(path, args, metadata, inputs, prefill, tokens, decode)


# ------------------------------------------------------------------------------ compare
def relative_error(found: torch.Tensor, reference: torch.Tensor) -> float:
    """max |found - reference| / max |reference|; inf on NaN/inf or a shape mismatch."""
    if found.shape != reference.shape:
        return math.inf
    found, reference = found.double(), reference.double()
    if not (torch.isfinite(found).all() and torch.isfinite(reference).all()):
        return math.inf
    scale = reference.abs().max().item() if reference.numel() else 0.0
    diff = (found - reference).abs().max().item() if reference.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


@dataclass(frozen=True)
class Divergence:
    """A greedy token that differs: generated token `index` (sequence position `position`)."""
    index: int
    position: int
    row: int
    found: int
    expected: int

    def describe(self) -> str:
        return (f"greedy token {self.index} (sequence position {self.position}, batch row {self.row}) "
                f"is {self.found}, expected {self.expected}")


@dataclass(frozen=True)
class Comparison:
    """One output of `subject` held against `reference`. For logits `error` is the relative
    max-abs error and `step` the decode step (None: prefill); for tokens it counts the
    differing greedy tokens out of `total`."""
    output: str                   # "prefill logits" | "decode logits" | "greedy tokens"
    subject: str                  # "eager" | the runner's name
    reference: str                # "golden" | "eager"
    error: float
    bound: float
    step: int | None = None
    total: int = 0
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.error <= self.bound          # False for NaN

    @property
    def label(self) -> str:
        return self.output if self.step is None else f"{self.output} [{self.step}]"

    def describe(self) -> str:
        what = f"{self.subject} vs {self.reference}: {self.label}"
        if self.output == "greedy tokens":
            return f"{what}: {int(self.error)}/{self.total} differ, first: {self.divergence.describe()}" \
                if self.divergence else f"{what}: identical"
        return f"{what}: relative max-abs error {self.error:.3g} (bound {self.bound:.0e})"


@dataclass
class GoldenReport:
    path: Path
    name: str
    metadata: dict[str, str]
    rows: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_divergence(self) -> int | None:
        """The first generated-token index whose greedy choice differs (eager or runner), or None."""
        found = [r.divergence.index for r in self.rows if r.divergence is not None]
        return min(found) if found else None

    def worst(self) -> list[Comparison]:
        """Per subject and output, the row with the largest error (the first failure if any fails)."""
        out: dict[tuple[str, str], Comparison] = {}
        for r in self.rows:
            key = (r.subject, r.output)
            best = out.get(key)
            if best is None or _worse(r, best):
                out[key] = r
        return list(out.values())

    def failure(self) -> str | None:
        """One line naming the first failure: a greedy divergence if there is one, else the worst error."""
        failed = [r for r in self.rows if not r.ok]
        if not failed:
            return None
        diverged = [r for r in failed if r.divergence is not None]
        row = min(diverged, key=lambda r: r.divergence.index) if diverged else max(failed, key=lambda r: r.error)
        more = len(failed) - 1
        return f"{self.path}: {row.describe()}" + (f" (and {more} more outputs out of bounds)" if more else "")

    def raise_for_failure(self) -> None:
        message = self.failure()
        if message is not None:
            raise GoldenMismatch(message)


def _worse(a: Comparison, b: Comparison) -> bool:
    if a.ok != b.ok:
        return not a.ok
    return not (a.error <= b.error)              # NaN counts as worse


def compare(subject: str, reference: str, found: Trace, expected: Trace, expected_tokens: torch.Tensor,
            prompt_len: int, bound: float) -> list[Comparison]:
    """Rows for prefill logits, each decode step's logits, and the greedy tokens.

    expected_tokens [B, N+1]: the recorded choice before each step and after the last one.
    """
    rows = [Comparison("prefill logits", subject, reference,
                       relative_error(found.prefill_logits, expected.prefill_logits), bound)]
    for i in range(expected.decode_logits.shape[1]):
        found_i = found.decode_logits[:, i]
        rows.append(Comparison("decode logits", subject, reference,
                               relative_error(found_i, expected.decode_logits[:, i]), bound, step=i))
    choices = greedy_choices(found)
    differ = choices != expected_tokens
    divergence = None
    if differ.any():
        index = int(differ.any(dim=0).nonzero()[0, 0])
        row = int(differ[:, index].nonzero()[0, 0])
        divergence = Divergence(index, prompt_len + index, row, int(choices[row, index]),
                                int(expected_tokens[row, index]))
    rows.append(Comparison("greedy tokens", subject, reference, float(differ.sum()), 0.0,
                           total=differ.numel(), divergence=divergence))
    return rows


def check(golden_file: str | os.PathLike, runner: Runner | None = None, *, model: Transformer | None = None,
          bound: float = GOLDEN_BOUND, runner_bound: float = RUNNER_BOUND,
          runner_name: str = "runner") -> GoldenReport:
    """Replay a golden file and return a report; raises only for an unreadable or invalid file.

    model: the eager model to replay (default: rebuilt from the stored config and seed); it must
    have the stored config. runner: a callable with the model's signature (e.g. `dsv41c.compile
    (model)`, which shares the model's caches), compared against the eager replay. Both are driven
    with the recorded tokens (teacher forcing); their greedy choices are compared with the recorded
    ones (eager) and with eager's (runner). runner_name labels the runner's rows.
    """
    golden = load_golden(golden_file)
    if model is None:
        model = golden.build_model()
    else:
        found = config_sha256(model.args)
        if found != golden.metadata["config_sha256"]:
            raise ConfigError(f"{golden.path}: the model's config hashes to sha256 {found}, but the golden "
                              f"file was recorded with config_sha256 {golden.metadata['config_sha256']}")
        if model.dtype != DTYPE or model.kv_quant != KV_QUANT:
            raise InputError(f"{golden.path}: the model is {model.dtype} with kv_quant={model.kv_quant}, "
                             f"expected torch.float32 with kv_quant={KV_QUANT} (the recorded numerics)")
    device = model.device
    inputs, tokens = golden.inputs.to(device), golden.decode_tokens.to(device)
    recorded = torch.cat([tokens, golden.decode_logits[:, -1:].argmax(-1)], dim=1) if tokens.shape[1] \
        else golden.prefill_logits[:, -1:].argmax(-1)
    report = GoldenReport(golden.path, golden.name, golden.metadata)
    with _no_tf32():
        eager = _to_cpu(run_teacher_forced(model, inputs, tokens))
        report.rows += compare("eager", "golden", eager, golden.trace, recorded, golden.prompt_len, bound)
        if runner is not None:
            model.reset_cache()
            found = _to_cpu(run_teacher_forced(runner, inputs, tokens))
            report.rows += compare(runner_name, "eager", found, eager, greedy_choices(eager), golden.prompt_len,
                                   runner_bound)
    model.reset_cache()
    return report


def _to_cpu(trace: Trace) -> Trace:
    return Trace(trace.prefill_logits.detach().cpu(), trace.decode_logits.detach().cpu())
